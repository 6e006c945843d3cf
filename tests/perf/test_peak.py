"""Peak table matching, the override, and the cached CPU matmul calibration."""

import dataclasses
import json
import math

import jax
import pytest

from jaxrl.perf import peak as peak_module
from jaxrl.perf.peak import Peak, memory_bandwidth, peak_flops

SIZE = 256  # a small calibration matmul keeps the tests fast


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


@pytest.mark.parametrize("device_kind, tflops, bandwidth", [
    ("TPU v4", 275, 1.2e12),
    ("TPU v5 lite", 197, 8.2e11),
    ("TPU v5e", 197, 8.2e11),
    ("TPU v5p", 459, 2.76e12),
    ("TPU v5", 459, 2.76e12),
    ("TPU v6 lite", 918, 1.64e12),
    ("TPU v6e", 918, 1.64e12),
    ("TPU7x", 2307, 7.4e12),
    ("NVIDIA A100-SXM4-80GB", 312, 2.0e12),
    ("NVIDIA H100 80GB HBM3", 989, 3.35e12),
    ("NVIDIA H200", 989, 4.8e12),
    ("nvidia b200", 2250, 8.0e12),
])
def test_table_matches_device_kind(device_kind, tflops, bandwidth):
    platform = "tpu" if "tpu" in device_kind.lower() else "gpu"
    device = FakeDevice(device_kind, platform)
    peak = peak_flops(device)
    assert peak.flops_per_s == tflops * 1e12
    assert peak.source.startswith("table: ") and device_kind in peak.source
    assert memory_bandwidth(device) == bandwidth


def test_v5_lite_is_not_v5p():
    assert peak_flops(FakeDevice("TPU v5 lite", "tpu")).flops_per_s == 197e12
    assert "TPU v5e" in peak_flops(FakeDevice("TPU v5 lite", "tpu")).source
    assert peak_flops(FakeDevice("TPU v5p", "tpu")).flops_per_s == 459e12


def test_override_wins_over_table_and_calibration(tmp_path, monkeypatch):
    monkeypatch.setattr(peak_module, "measure_matmul_flops", _must_not_measure)
    for device in (FakeDevice("NVIDIA H100", "gpu"), FakeDevice("Mystery X1", "gpu"),
                   jax.devices()[0]):
        peak = peak_flops(device, override_tflops=100.0, cache_path=tmp_path / "peak.json")
        assert peak == Peak(100e12, "config: perf.peak_tflops = 100")
    with pytest.raises(ValueError, match="-1"):
        peak_flops(FakeDevice("NVIDIA H100"), override_tflops=-1.0)


def test_unknown_accelerator_without_override_names_device_kind():
    with pytest.raises(ValueError, match=r"'Mystery X1'.*perf\.peak_tflops"):
        peak_flops(FakeDevice("Mystery X1", "gpu"))
    assert memory_bandwidth(FakeDevice("Mystery X1", "gpu")) is None


def test_cpu_calibration_is_measured_then_cached(tmp_path, monkeypatch):
    cache = tmp_path / "sub" / "peak.json"
    first = peak_flops(jax.devices()[0], cache_path=cache, calibration_size=SIZE)
    assert math.isfinite(first.flops_per_s) and first.flops_per_s > 0
    assert first.source.startswith("measured: float32 256^3") and "saved to" in first.source
    (host_rate,) = json.loads(cache.read_text()).values()
    assert host_rate == pytest.approx(first.flops_per_s * jax.local_device_count())

    monkeypatch.setattr(peak_module, "measure_matmul_flops", _must_not_measure)
    second = peak_flops(jax.devices()[0], cache_path=cache, calibration_size=SIZE)
    assert second.flops_per_s == first.flops_per_s
    assert f"cached in {cache}" in second.source


def test_host_rate_is_shared_by_the_local_cpu_devices(tmp_path, monkeypatch):
    assert jax.local_device_count() == 8  # tests/conftest.py
    monkeypatch.setattr(peak_module, "measure_matmul_flops", lambda device, size: 8e9)
    peak = peak_flops(jax.devices()[3], cache_path=tmp_path / "peak.json", calibration_size=SIZE)
    assert peak.flops_per_s == 1e9
    assert "8e+09 FLOP/s shared by 8 CPU devices" in peak.source


@pytest.mark.parametrize("content", ["not json{", "[1, 2]", '{"key": "fast"}'])
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, monkeypatch, content):
    cache = tmp_path / "peak.json"
    cache.write_text(content)
    monkeypatch.setattr(peak_module, "measure_matmul_flops", lambda device, size: 4e9)
    peak = peak_flops(jax.devices()[0], cache_path=cache, calibration_size=SIZE)
    assert peak.flops_per_s == 4e9 / 8
    assert list(json.loads(cache.read_text()).values()) == [4e9]
    assert [p.name for p in tmp_path.iterdir()] == ["peak.json"]  # no temp file left behind


def test_cache_keeps_other_machines_and_sizes(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    cache.write_text(json.dumps({"another machine": 5e10}))
    monkeypatch.setattr(peak_module, "measure_matmul_flops", lambda device, size: 8e9)
    peak_flops(jax.devices()[0], cache_path=cache, calibration_size=SIZE)
    peak_flops(jax.devices()[0], cache_path=cache, calibration_size=2 * SIZE)
    rates = json.loads(cache.read_text())
    assert rates["another machine"] == 5e10
    assert sorted(k.rsplit("|", 1)[1] for k in rates if k != "another machine") == [
        " float32 256^3", " float32 512^3"]


def test_default_cache_path_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path))
    assert peak_module.default_cache_path() == tmp_path / "peak.json"
    monkeypatch.delenv("JAXRL_CACHE_DIR")
    assert peak_module.default_cache_path().parts[-3:] == (".cache", "jaxrl", "peak.json")


def _must_not_measure(device, size):
    raise AssertionError("the calibration ran although its result should come from elsewhere")
