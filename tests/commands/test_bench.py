"""`jaxrl bench`: warm-up + measured steps, a JSON line with every key, MFU that adds up, a
profiler trace with --profile, and config errors exit 2."""

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from jaxrl.cli import EXIT_CONFIG_ERROR, main
from jaxrl.commands import bench as bench_module
from jaxrl.commands.bench import BENCH_KEYS
from jaxrl.models import ModelConfig
from jaxrl.perf.profile import GROUPS
from jaxrl.run.metrics_log import read_metrics
from tests.run.test_loop import QUICKSTART, SMALL


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bench") / "run"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", str(QUICKSTART), *SMALL, f"train.run_dir={run_dir}",
                     "--steps", "2", "--warmup", "1", "--profile"])
    return code, json.loads(stdout.getvalue().splitlines()[-1]), run_dir


def test_bench_prints_a_json_line_with_every_key(bench):
    code, result, run_dir = bench
    assert code == 0
    assert tuple(result) == BENCH_KEYS
    assert result["steps"] == 2 and result["warmup"] == 1
    assert result["num_devices"] == 8 and result["device_kind"] == "cpu"
    assert result["num_processes"] == 1
    assert json.loads((run_dir / "bench.json").read_text()) == result
    # Warm-up and measured steps are all in metrics.jsonl.
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]


def test_bench_numbers_add_up(bench):
    _, r, _ = bench
    assert r["tokens_per_s"] > 0 and r["completion_tokens_per_step"] > 0
    assert 0 < r["generate_s"] and 0 < r["train_s"]
    assert r["generate_s"] + r["train_s"] <= r["step_s"] + 1e-3
    assert r["model_flops_per_step"] == pytest.approx(
        r["model_flops_generate"] + r["model_flops_train"])
    assert r["xla_flops_per_step"] >= 0.99 * r["model_flops_per_step"]
    assert 0.9 < r["analytic_flops_per_step"] / r["model_flops_per_step"] <= 1.0
    # MFU = model FLOPs / (step seconds x devices x peak per device), HFU with XLA FLOPs.
    denominator = r["step_s"] * r["num_devices"] * r["peak_flops_per_device"]
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / denominator)
    assert r["hfu"] == pytest.approx(r["xla_flops_per_step"] / denominator)
    assert r["train_mfu"] == pytest.approx(r["model_flops_train"] / (
        r["train_s"] * r["num_devices"] * r["peak_flops_per_device"]))
    assert "measured" in r["peak_source"]  # CPU: a matmul calibration, not a table
    # CPUs have no memory-bandwidth entry: the decode roofline is unknown, not invented.
    assert r["decode_bound_tokens_per_s"] is None
    assert r["decode_roofline_frac"] is None
    assert 0 < r["peak_memory_bytes"] < r["device_memory_bytes"]
    assert r["flops_unknown"] == []


def test_decode_roofline_frac_reads_weights_and_live_kv(monkeypatch):
    """Weights (an untied input embedding left out) plus each row's prompt and the tokens
    decoded so far, (D + 1) / 2 on average over D steps, against the bandwidth of every device."""
    monkeypatch.setattr(bench_module, "memory_bandwidth", lambda device: 1e9)
    config = ModelConfig(model_type="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                         tie_word_embeddings=False, compute_dtype="bfloat16")
    run = SimpleNamespace(mesh=SimpleNamespace(local_devices=[None]), rows=4,
                          model_config=config)
    pre = SimpleNamespace(num_devices=2)
    step_bytes = 2 * (config.num_params() - 100 * 16 + (2 * 2 * 2 * 4) * 4 * (6 + (9 + 1) / 2))
    bound_tokens_per_s = 4 / (step_bytes / (2 * 1e9))
    assert bench_module._decode_roofline_frac(run, pre, 1000.0, 9, 6.0) == pytest.approx(
        1000.0 / bound_tokens_per_s)
    assert bench_module._decode_roofline_frac(run, pre, 1000.0, 0, 6.0) is None  # no decode step


def test_bench_profile_writes_a_trace(bench):
    _, result, run_dir = bench
    assert result["profile_dir"] == str(run_dir / "profile")
    traces = list((run_dir / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
    # Where the device time went, per step: the step's matmuls and attention are in it.
    split = result["profile_split_s"]
    assert tuple(split) == GROUPS
    assert split["matmul"] > 0 and split["attention"] > 0 and split["copies"] > 0
    assert split["collectives"] > 0  # fsdp over the 8 test devices gathers the weights
    top = result["profile_top"]
    assert len(top) == 10 and all(t["group"] in GROUPS and t["s_per_step"] > 0 for t in top)
    assert [t["s_per_step"] for t in top] == sorted((t["s_per_step"] for t in top), reverse=True)


def test_bench_config_errors_exit_2(tmp_path, capsys):
    code = main(["bench", str(QUICKSTART), *SMALL, f"train.run_dir={tmp_path / 'run'}",
                 "perf.peak_tflops=-1"])
    assert code == EXIT_CONFIG_ERROR
    assert "perf.peak_tflops" in capsys.readouterr().err
    assert main(["bench", str(QUICKSTART), *SMALL, f"train.run_dir={tmp_path / 'run2'}",
                 "--steps", "0"]) == EXIT_CONFIG_ERROR
