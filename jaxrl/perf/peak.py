"""Peak FLOP/s and memory bandwidth of one device: the denominators of MFU.

Accelerators are looked up by `device.device_kind` in a table of dense bf16 peaks (vendor
data sheets, without sparsity). A CPU has no meaningful data-sheet figure for XLA's code, so
its peak is *measured*: the best of several timed float32 N×N @ N×N matmuls on one device.
The CPU "devices" that `--xla_force_host_platform_device_count` creates share the host's
cores, so the host rate is divided among them:

    peak per CPU device = 2·N³ / best matmul seconds / local CPU device count

The host rate is cached in a JSON file keyed by a machine signature (CPU model, core count,
jax version, matmul size and dtype), so only the first run on a machine pays for it. A
config value (`perf.peak_tflops`) overrides both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

CACHE_DIR_ENV = "JAXRL_CACHE_DIR"
CALIBRATION_SIZE = 2048
_WARMUP_RUNS = 2
_TIMED_RUNS = 5


@dataclasses.dataclass(frozen=True)
class _Chip:
    name: str
    bf16_tflops: float
    hbm_bytes_per_s: float
    kinds: tuple[str, ...]  # lower-case substrings of device_kind that identify the chip


# Order matters: the first chip with a matching substring wins, and "tpu v5" (v5p's old
# device_kind) is a substring of "tpu v5 lite" (v5e), so v5e is listed first.
_CHIPS = (
    _Chip("TPU v5e", 197.0, 8.2e11, ("tpu v5 lite", "tpu v5e")),
    _Chip("TPU v5p", 459.0, 2.76e12, ("tpu v5p", "tpu v5")),
    _Chip("TPU v6e", 918.0, 1.64e12, ("tpu v6 lite", "tpu v6e")),
    _Chip("TPU v4", 275.0, 1.2e12, ("tpu v4",)),
    _Chip("TPU7x", 2307.0, 7.4e12, ("tpu7x",)),
    _Chip("NVIDIA A100", 312.0, 2.0e12, ("a100",)),
    _Chip("NVIDIA H100", 989.0, 3.35e12, ("h100",)),
    _Chip("NVIDIA H200", 989.0, 4.8e12, ("h200",)),
    _Chip("NVIDIA B200", 2250.0, 8.0e12, ("b200",)),
)


@dataclasses.dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device, and where the figure came from (printed beside the MFU)."""

    flops_per_s: float
    source: str


def _chip(device_kind: str) -> _Chip | None:
    kind = " ".join(device_kind.lower().split())
    return next((c for c in _CHIPS if any(k in kind for k in c.kinds)), None)


def peak_flops(device: jax.Device | None = None, *, override_tflops: float | None = None,
               cache_path: str | os.PathLike | None = None,
               calibration_size: int = CALIBRATION_SIZE, refresh: bool = False) -> Peak:
    """Peak FLOP/s of `device` (default: the first device): override, table, or CPU calibration.

    On CPU the cached host rate is used unless `refresh`: then the matmul is measured again
    and the cache keeps the best rate seen (`jaxrl bench` refreshes). Raises ValueError for
    an accelerator missing from the table when no override is given.
    """
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"perf.peak_tflops must be > 0, got {override_tflops}")
        return Peak(override_tflops * 1e12, f"config: perf.peak_tflops = {override_tflops:g}")
    device = device if device is not None else jax.local_devices()[0]
    chip = _chip(device.device_kind)
    if chip is not None:
        return Peak(chip.bf16_tflops * 1e12,
                    f"table: {device.device_kind} as {chip.name}, dense bf16")
    if device.platform != "cpu":
        raise ValueError(f"no peak FLOP/s known for device_kind {device.device_kind!r} "
                         f"(platform {device.platform!r}); set perf.peak_tflops to its dense "
                         f"bf16 peak in TFLOP/s per device")
    return _cpu_peak(device, Path(cache_path) if cache_path else default_cache_path(),
                     calibration_size, refresh)


def memory_bandwidth(device: jax.Device | None = None) -> float | None:
    """HBM bandwidth of `device` in bytes/s from the table; None when the chip is unknown."""
    device = device if device is not None else jax.local_devices()[0]
    chip = _chip(device.device_kind)
    return chip.hbm_bytes_per_s if chip is not None else None


def default_cache_path() -> Path:
    """`$JAXRL_CACHE_DIR/peak.json`, else `~/.cache/jaxrl/peak.json`."""
    cache_dir = os.environ.get(CACHE_DIR_ENV)
    return (Path(cache_dir) if cache_dir else Path.home() / ".cache" / "jaxrl") / "peak.json"


def measure_matmul_flops(device: jax.Device, size: int = CALIBRATION_SIZE) -> float:
    """FLOP/s of the best of several timed float32 size³ matmuls on `device` (2·size³ each)."""
    if size < 1:
        raise ValueError(f"calibration matmul size must be >= 1, got {size}")
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (size, size), jnp.float32), device)
    b = jax.device_put(jax.random.normal(key_b, (size, size), jnp.float32), device)
    matmul = jax.jit(jnp.matmul)
    for _ in range(_WARMUP_RUNS):  # compilation, page faults and thread-pool start-up
        matmul(a, b).block_until_ready()
    best_s = math.inf
    for _ in range(_TIMED_RUNS):  # best, not mean: other processes only ever slow a run down
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best_s = min(best_s, time.perf_counter() - start)
    return 2.0 * size**3 / best_s


def _machine_signature(size: int) -> str:
    cpu_model = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f
                              if line.startswith("model name")), cpu_model)
    except OSError:
        pass  # not Linux: core count and jax version still tell machines apart
    return f"{cpu_model} | {os.cpu_count()} cpus | jax {jax.__version__} | float32 {size}^3"


def _read_cache(path: Path) -> dict[str, float]:
    """The cached host rates; {} for a missing, unreadable or corrupt file (it is rewritten)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if type(v) in (int, float) and math.isfinite(v) and v > 0}


def _write_cache(path: Path, rates: dict[str, float]) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(rates, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _cpu_peak(device: jax.Device, cache_path: Path, size: int, refresh: bool) -> Peak:
    signature = _machine_signature(size)
    rates = _read_cache(cache_path)
    if signature in rates and not refresh:
        host_rate, how = rates[signature], f"cached in {cache_path}"
    else:
        # The best rate ever measured: a busy machine only ever makes a measurement slower.
        host_rate = max(measure_matmul_flops(device, size), rates.get(signature, 0.0))
        rates[signature] = host_rate
        try:
            _write_cache(cache_path, rates)
            how = f"saved to {cache_path}"
        except OSError as e:  # a read-only home must not stop training; the figure stands
            how = f"not cached: {e}"
    num_devices = jax.local_device_count(device.platform)
    return Peak(host_rate / num_devices,
                f"measured: float32 {size}^3 matmul on this host, {host_rate:.3g} FLOP/s "
                f"shared by {num_devices} CPU devices ({how})")
