"""`jaxrl bench CONFIG [overrides] [--steps N] [--warmup W] [--profile]`: measure the RL step.

    start_run(cfg)                         the same start as `jaxrl train` (a new run dir):
                                           build, compile ahead of time, memory fit, FLOP
                                           count, peak FLOP/s (on CPU measured afresh)
    Trainer(started, ..., hooks).run_steps()   W warm-up steps, then N measured steps: the
                                           trainer of `jaxrl train` (`jaxrl.run.trainer`)
                                           with the curriculum hook, the step timer and,
                                           with --profile, the profiler (`jaxrl.run.hooks`)
    print a table and, as the last line of stdout, one JSON object (`BENCH_KEYS`)

The step timer (`hooks/timing.py`) waits for each step and times it on the host (dispatch
to outputs ready), so the numbers are the latency of a step, not hidden by the next one's
dispatch, and keeps the measured steps' records. MFU/HFU use the median step; the
generate/train split comes from stamps inside the program (`jaxrl.step.clock`), each step
recorded as training's are (`jaxrl.run.recorder`). `decode_tokens_per_s` is completion
tokens / generate seconds, prefill included (a lower bound of the pure decode rate);
`decode_bound_tokens_per_s` is its roofline from the decode program's bytes accessed and the
device's memory bandwidth; `decode_roofline_frac` is decode_tokens_per_s over the roofline of
the bytes a step must read: the weights plus the live KV (`_decode_roofline_frac`), not the
whole preallocated cache. `peak_memory_bytes` is XLA's plan for the step program (per
device); `measured_peak_memory_bytes` the allocator's peak where the device reports one (not
CPU). `--profile` wraps the measured steps in a `jax.profiler` trace under
`<run_dir>/profile` (`hooks/profiling.py`; open with TensorBoard's profile plugin, XProf or
Perfetto) and prints where the device time went per step, grouped as matmul / attention /
copies / reductions / collectives / host / other with the top ops (`jaxrl.perf.profile`; in
the JSON as `profile_split_s`, `profile_top`).
The run directory also gets `bench.json` (the JSON line) and `metrics.jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.distributed import is_main
from jaxrl.perf import (
    IMPLAUSIBLE,
    format_bytes,
    format_flops,
    memory_bandwidth,
    plausible,
    utilization,
)
from jaxrl.perf.profile import TraceSplit, op_groups, summarize_trace
from jaxrl.run.build import Run
from jaxrl.run.hooks.curriculum import CurriculumHook
from jaxrl.run.hooks.profiling import ProfileHook
from jaxrl.run.hooks.timing import StepTimer
from jaxrl.run.metrics_log import MetricsLog
from jaxrl.run.preflight import Preflight
from jaxrl.run.recorder import StepRecorder
from jaxrl.run.start import start_run
from jaxrl.run.trainer import Trainer
from jaxrl.saved.files import BENCH_FILE, PROFILE_DIR

# Keys of the final JSON line (a value is null when it cannot be measured honestly, e.g.
# FLOPs when cost analysis gave none).
BENCH_KEYS = (
    "config", "run_dir", "steps", "warmup", "device_kind", "num_devices", "num_processes",
    "completion_tokens_per_step", "tokens_per_s", "step_s", "step_s_min", "generate_s",
    "train_s", "mfu", "hfu", "generate_mfu", "train_mfu", "model_flops_per_step",
    "xla_flops_per_step", "analytic_flops_per_step", "model_flops_generate",
    "model_flops_train", "train_flops_count", "real_token_frac", "packed_frac", "decode_steps", "decode_tokens_per_s", "decode_bound_tokens_per_s",
    "decode_roofline_frac",
    "peak_flops_per_device", "peak_source", "peak_memory_bytes", "measured_peak_memory_bytes",
    "device_memory_bytes", "memory_source", "compile_s", "count_flops_s", "flops_unknown", "profile_dir",
    "profile_split_s", "profile_top", "utilization_note",
)


def run_bench(cfg: ExperimentConfig, console: Console, config_path: str | None, *,
              steps: int = 5, warmup: int = 2, profile: bool = False) -> dict[str, Any]:
    """Benchmarks the step of `cfg` (module docstring); returns the JSON object."""
    if steps < 1 or warmup < 0:
        raise ConfigError(f"bench needs --steps >= 1 and --warmup >= 0, got --steps {steps} "
                          f"--warmup {warmup}")
    # The phase split is part of what bench reports; it waits for every step anyway, so the
    # stamps cost no overlap here (PerfSection.phase_times).
    cfg = dataclasses.replace(cfg, perf=dataclasses.replace(cfg.perf, phase_times=True))
    name = f"bench-{Path(config_path).stem if config_path else 'run'}"
    started = start_run(cfg, name, console, resumable=False, refresh_peak=True)
    run = started.run

    profile_dir = run.run_dir / PROFILE_DIR if profile else None
    if profile_dir is not None and jax.process_count() > 1:
        profile_dir = profile_dir / f"process-{jax.process_index()}"  # a trace per process
    timer = StepTimer(console, warmup, warmup + steps)
    hooks = [CurriculumHook(), timer]
    if profile_dir is not None:
        hooks.insert(0, ProfileHook(profile_dir, warmup, console))  # started before the timer
    log = MetricsLog(run.run_dir, tensorboard=False)
    try:
        Trainer(started, StepRecorder(run, started.pre, log), hooks, warmup + steps).run_steps()
    finally:
        log.close()
    result = _result(run, started.pre, timer.records, config_path, warmup, profile_dir,
                     float(np.mean(timer.prompt_lens)))
    if profile_dir is not None:
        split = summarize_trace(profile_dir, op_groups(
            [c.as_text() for c in run.step.compiled().values()]), steps)
        result["profile_split_s"] = split.group_s
        result["profile_top"] = [{"op": op, "group": group, "s_per_step": sec,
                                  "calls_per_step": calls} for op, group, sec, calls in split.top]
        console.print(_split_table(split))
    if is_main():  # one writer; the other processes' host timings are their own
        (run.run_dir / BENCH_FILE).write_text(json.dumps(result) + "\n", encoding="utf-8")
    console.print(_table(result))
    return result


def _median(records: list[dict[str, Any]], name: str) -> float | None:
    values = [r[name] for r in records if name in r]
    return float(np.median(values)) if values else None


def _result(run: Run, pre: Preflight, records: list[dict[str, Any]],
            config_path: str | None, warmup: int, profile_dir: Path | None,
            prompt_len_mean: float) -> dict[str, Any]:
    step_s = _median(records, "time/step_s")
    generate_s, train_s = _median(records, "time/generate_s"), _median(records, "time/train_s")
    tokens = float(np.mean([r["completion/len_mean"] for r in records])) * run.rows
    decode_steps = int(round(np.median([r["rollout/num_steps"] for r in records]))) - 1
    acc = pre.accounting
    model = xla = analytic = gen_flops = train_flops = None
    packed: dict[str, float] = {}
    if acc is not None:
        run_steps = acc.decode_steps(_median(records, "rollout/decode_slot_steps"))
        # A packed step's train work follows its tokens (`StepAccounting.metrics`).
        packed = {name: _median(records, name) for name in
                  ("train/real_token_frac", "train/run_row_frac")
                  if records and name in records[0]}
        flops = acc.metrics(run_steps, packed)
        model, xla, analytic = (flops["perf/model_flops"], flops["perf/xla_flops"],
                                flops["perf/analytic_flops"])
        gen_flops, train_flops = acc.model.generate_flops(run_steps), acc.model.train_flops(
            packed.get("train/real_token_frac", 1.0))

    def util(flops, seconds):
        if flops is None or not seconds or pre.peak is None:
            return None
        return utilization(flops, seconds, pre.num_devices, pre.peak.flops_per_s)

    decode_tokens_per_s = run.rows * (decode_steps + 1) / generate_s if generate_s else None
    result = {
        "config": config_path, "run_dir": str(run.run_dir), "steps": len(records),
        "warmup": warmup, "device_kind": pre.device_kind, "num_devices": pre.num_devices,
        "num_processes": jax.process_count(), "completion_tokens_per_step": tokens,
        "tokens_per_s": tokens * len(records) / sum(r["time/step_s"] for r in records),
        "step_s": step_s, "step_s_min": min(r["time/step_s"] for r in records),
        "generate_s": generate_s, "train_s": train_s,
        "mfu": util(model, step_s), "hfu": util(xla, step_s),
        "generate_mfu": util(gen_flops, generate_s), "train_mfu": util(train_flops, train_s),
        "model_flops_per_step": model, "xla_flops_per_step": xla,
        "analytic_flops_per_step": analytic, "model_flops_generate": gen_flops,
        "model_flops_train": train_flops,
        "train_flops_count": ("the real tokens (packed steps: the padded programs' train FLOPs "
                              "x train/real_token_frac)") if acc is not None and packed
        else "the padded rows",
        "real_token_frac": _median(records, "train/real_token_frac"),
        "packed_frac": _median(records, "train/packed_frac"),
        "decode_steps": decode_steps,
        "decode_tokens_per_s": decode_tokens_per_s,
        "decode_bound_tokens_per_s": _decode_bound(run, pre),
        "decode_roofline_frac": _decode_roofline_frac(run, pre, decode_tokens_per_s,
                                                      decode_steps, prompt_len_mean),
        "peak_flops_per_device": pre.peak.flops_per_s if pre.peak else None,
        "peak_source": pre.peak.source if pre.peak else "unknown: set perf.peak_tflops",
        "peak_memory_bytes": pre.memory.peak_bytes if pre.memory.programs else None,
        "measured_peak_memory_bytes": _measured_peak(run),
        "device_memory_bytes": pre.memory.limit_bytes or None, "memory_source": pre.memory.limit_source,
        "compile_s": pre.compile_s, "count_flops_s": pre.count_s,
        "flops_unknown": (acc.model.unknown() + acc.hardware.unknown()) if acc else None,
        "profile_dir": str(profile_dir) if profile_dir else None,
        "profile_split_s": None, "profile_top": None,
        "utilization_note": None,
    }
    impossible = [k for k in ("mfu", "hfu", "generate_mfu", "train_mfu")
                  if result[k] is not None and plausible(result[k]) is None]
    if impossible:
        result["utilization_note"] = (f"{', '.join(f'{k} {result[k]:.3f}' for k in impossible)}: "
                                      f"{IMPLAUSIBLE}")
        result.update({k: None for k in impossible})
    return result


def _measured_peak(run: Run) -> int | None:
    """The allocator's peak bytes in use on the first device (GPU/TPU; None on CPU)."""
    stats = run.mesh.local_devices[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _decode_bound(run: Run, pre: Preflight) -> float | None:
    """Tokens/s if every decode step only had to read its bytes (XLA's bytes accessed of the
    decode program, per device) at the device's memory bandwidth: the roofline of decoding."""
    bandwidth = memory_bandwidth(run.mesh.local_devices[0])
    if pre.accounting is None or bandwidth is None:
        return None
    decode = next(p for p in pre.accounting.hardware.generate if p.per_decode_step).cost
    if decode.bytes_accessed is None:
        return None
    # Bytes of the whole decode program (counted on one host device), read by all devices;
    # it draws one token for each of its rows (the engine's slots, or the dense B).
    return pre.accounting.rows / (decode.bytes_accessed / (pre.num_devices * bandwidth))


def _decode_roofline_frac(run: Run, pre: Preflight, decode_tokens_per_s: float | None,
                          decode_steps: int, prompt_len_mean: float) -> float | None:
    """decode_tokens_per_s over the roofline of `_decode_bound`, its bytes the ones a decode
    step must read rather than XLA's bytes of the dense program (which attends over the whole
    preallocated cache): with W the parameters (an untied input embedding left out: a step
    gathers B rows of it), D the decode steps, n_b row b's real prompt tokens, kv = 2 * layers
    * kv_heads * head_dim bytes per token, all in the compute dtype (the rollout's weights),

        bytes = W + kv * sum_b (n_b + (D + 1) / 2)

    the live KV: at decode step t = 1..D row b attends over its n_b + t tokens. Every row
    counts at every step, as in decode_tokens_per_s (a row that stopped early is counted to the
    loop's end, so this overstates what the engine must read when rows stop on EOS)."""
    bandwidth = memory_bandwidth(run.mesh.local_devices[0])
    if bandwidth is None or not decode_tokens_per_s or decode_steps < 1:
        return None
    c = run.model_config
    itemsize = jnp.dtype(c.compute_dtype).itemsize
    weights = c.num_params() - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)
    kv_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim
    step_bytes = itemsize * (weights + kv_token * run.rows * (prompt_len_mean
                                                               + (decode_steps + 1) / 2))
    # As `_decode_bound`: the step's bytes (one host's count) spread over every device.
    bound_tokens_per_s = run.rows / (step_bytes / (pre.num_devices * bandwidth))
    return decode_tokens_per_s / bound_tokens_per_s


def _split_table(split: TraceSplit) -> Table:
    """Device time per step by group (`jaxrl.perf.profile`), then the ops that took most."""
    table = Table(title=f"where the device time goes (per step, {split.steps} profiled steps)")
    for column in ("group / op", "ms per step", "share"):
        table.add_column(column, justify="left" if column == "group / op" else "right")
    total = split.total_s or 1.0
    for group, seconds in sorted(split.group_s.items(), key=lambda kv: -kv[1]):
        table.add_row(group, f"{seconds * 1e3:.2f}", f"{seconds / total:.1%}")
    table.add_section()
    for op, group, seconds, calls in split.top:
        table.add_row(f"{op} ({group}, {calls:g}x)", f"{seconds * 1e3:.2f}",
                      f"{seconds / total:.1%}")
    table.caption = ("op events summed over the device's threads (a multi-threaded CPU can "
                     "exceed the step's wall time); host Python not counted")
    return table


def _table(result: dict[str, Any]) -> Table:
    table = Table(title=f"jaxrl bench: {result['steps']} steps on {result['num_devices']} x "
                        f"{result['device_kind']}")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(value, kind):
        if value is None:
            return "n/a"
        return {"pct": f"{value:.1%}", "s": f"{value * 1e3:.1f} ms", "flops": format_flops(value),
                "bytes": format_bytes(value), "rate": f"{value:,.0f}"}[kind]

    for name, kind in (("tokens_per_s", "rate"), ("step_s", "s"), ("generate_s", "s"),
                       ("train_s", "s"), ("mfu", "pct"), ("hfu", "pct"),
                       ("generate_mfu", "pct"), ("train_mfu", "pct"),
                       ("model_flops_per_step", "flops"), ("xla_flops_per_step", "flops"),
                       ("analytic_flops_per_step", "flops"), ("decode_tokens_per_s", "rate"),
                       ("decode_bound_tokens_per_s", "rate"), ("decode_roofline_frac", "pct"),
                       ("peak_memory_bytes", "bytes"),
                       ("device_memory_bytes", "bytes")):
        table.add_row(name, fmt(result[name], kind))
    peak = result["peak_flops_per_device"]
    table.add_row("peak_flops_per_device", "n/a" if peak is None else f"{peak / 1e12:.3g} TFLOP/s")
    table.caption = f"peak: {result['peak_source']}"
    return table
