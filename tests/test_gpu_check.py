"""`benchmarks/gpu_check.sh`: its `--tiny` CPU run writes the report the GPU run would (the
bench's and the engine line's), and a missing runtime dependency stops it at once, by name;
its GPU config is the model it claims."""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import jax
import pytest

from jaxrl.config import ExperimentConfig, load_config
from jaxrl.rollout.pages import PoolLayout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
HEADLINE = ("train_mfu", "decode_tokens_per_s", "decode_bound_tokens_per_s", "mfu", "hfu",
            "peak_memory_bytes")


def _run(out: Path, python: str, tmp_path: Path, *args: str,
         **extra_env: str) -> subprocess.CompletedProcess:
    # One device, as a user runs it: not the suite's 8 forced CPU devices.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(PYTHON=python, JAXRL_CACHE_DIR=str(tmp_path / "cache"),
               GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"), **extra_env)
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.process
def test_tiny_check_writes_bench_json_and_summary(tmp_path):
    out = tmp_path / "out"
    result = _run(out, sys.executable, tmp_path, "--tiny")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() for f in files) and len(files) <= 8, files
    assert {"bench.json", "engine.json", "log.txt", "summary.md"} <= set(files), files

    bench = json.loads((out / "bench.json").read_text())
    assert bench["num_devices"] == 1 and bench["device_kind"] == "cpu"
    assert bench["steps"] == 2 and bench["warmup"] == 1
    assert bench["tokens_per_s"] > 0 and bench["decode_tokens_per_s"] > 0
    assert 0 < bench["mfu"] <= bench["hfu"] < 1.5, (bench["mfu"], bench["hfu"])
    assert 0 < bench["train_mfu"] < 1.5 and 0 < bench["generate_mfu"] < 1.5
    assert bench["peak_memory_bytes"] > 0
    assert bench["decode_bound_tokens_per_s"] is None  # no HBM bandwidth on CPU
    # --tiny keeps every completion at rollout.max_new_tokens=8 (ignore_eos), 8 x 4 rows
    assert bench["completion_tokens_per_step"] == 8 * 8 * 4 and bench["decode_steps"] == 7

    summary = (out / "summary.md").read_text()
    for key in HEADLINE:
        assert f"`{key}`" in summary, key
    assert f"| jax | {jax.__version__}" in summary and "| device_kind | cpu" in summary
    bound_row = next(row for row in summary.splitlines() if "`decode_bound_tokens_per_s`" in row)
    assert "| n/a |" in bound_row, bound_row
    assert "| result | ok |" in summary

    # The engine line: decode.py over every device the process sees (here the one CPU
    # device), 8 rows of 8 + 8 tokens, all in slots at once; its pool is the whole plan's.
    engine = json.loads((out / "engine.json").read_text())
    assert engine["device"] == "1 x cpu" and engine["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert (engine["batching"], engine["batch"], engine["slots"]) == ("continuous", 8, 8)
    assert engine["generated_tokens"] == 8 * 8 and engine["tokens_per_s"] > 0
    assert "--devices" not in engine["command"] and "--layout fsdp" in engine["command"]
    pool = PoolLayout.plan(page_size=4, num_prompts=8, prompt_len=8, max_new_tokens=8,
                           num_slots=8)
    page_bytes = 2 * 4 * (2 * 2) * 16 * 4  # layers x page x 2K x head_dim x float32
    assert engine["kv_bytes_per_device"] == pool.num_pages * page_bytes, engine
    engine_part = summary[summary.index("## Rollout engine (benchmarks/decode.py, exit 0)"):]
    for key in ("tokens_per_s", "kv_bytes_per_device", "decode_step_s"):
        assert f"`{key}`" in engine_part, key
    assert f"{engine['kv_bytes_per_device']:,} B" in engine_part

    log = (out / "log.txt").read_text()
    assert "engine line exited with status 0" in log
    assert "bench exited with status 0" in log and log.rstrip().splitlines()[-1].startswith(
        "[gpu_check"), log[-2000:]


@pytest.mark.process
def test_missing_dependencies_fail_fast_by_name(tmp_path):
    venv.create(tmp_path / "bare", with_pip=False)  # a Python without jaxrl's dependencies
    out = tmp_path / "out"
    result = _run(out, str(tmp_path / "bare" / "bin" / "python"), tmp_path, "--tiny")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "FAILED: jaxrl's runtime dependencies are not all here" in result.stdout
    missing = next(line for line in result.stdout.splitlines() if "missing:" in line)
    for dep in ("jax>=", "flax>=", "omegaconf>=", "datasets>=", "math-verify>="):
        assert dep in missing, (dep, missing)
    assert "tensorboardX" not in missing  # log.tensorboard is off: not needed for the check
    assert not (out / "bench.json").exists()
    assert "FAILED before the bench" in (out / "summary.md").read_text()
    assert "omegaconf" in (out / "log.txt").read_text()


@pytest.mark.process
def test_gpu_run_without_a_gpu_stops_before_the_bench(tmp_path):
    out = tmp_path / "out"
    # JAX_PLATFORMS=cpu: JAX sees no GPU even where there is one, so nothing big ever runs.
    result = _run(out, sys.executable, tmp_path, JAX_PLATFORMS="cpu")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-2000:]
    assert "FAILED: no GPU visible to JAX" in result.stdout and "--tiny" in result.stdout
    assert "running (timeout" not in result.stdout and not (out / "bench.json").exists()
    assert "engine line (timeout" not in result.stdout and not (out / "engine.json").exists()


def test_gpu_config_is_qwen2_5_1_5b_shaped():
    cfg = load_config(ExperimentConfig, ROOT / "benchmarks" / "gpu_qwen2_1.5b.yaml")
    init = cfg.model.init
    assert (init.family, init.hidden_size, init.intermediate_size, init.num_layers,
            init.num_heads, init.num_kv_heads, init.vocab_size, init.rope_theta,
            init.tie_word_embeddings) == ("qwen2", 1536, 8960, 28, 12, 2, 151936, 1e6, True)
    assert cfg.model.dtype == cfg.model.compute_dtype == "bfloat16"
    assert cfg.rollout.ignore_eos and cfg.sharding.layout == "single"
    h, kv = init.hidden_size, init.hidden_size // init.num_heads * init.num_kv_heads
    layer = (2 * h * h + h) + 2 * (h * kv + kv) + 3 * h * init.intermediate_size + 2 * h
    params = init.vocab_size * h + init.num_layers * layer + h
    assert abs(params - 1.54e9) < 0.01e9, params  # Qwen2.5-1.5B: 1.54B with tied embeddings
