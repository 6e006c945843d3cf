"""The training loop: build a run from its config, step it, log it, evaluate it.

    run = build_run(cfg, run_dir, console)   mesh, tokenizer, policy, task, prompts, step
    for step in range(max_steps):
        dispatch step N                  (returns at once: JAX runs it asynchronously)
        fetch step N-1's metrics         the device already works on N while the host logs
    save the final policy, evaluate greedily on held-out prompts, plot, print the summary

The host never waits on the device inside the loop except to fetch metrics one step late
(nanodo's pattern), so host work (next batch, logging) overlaps device work.

Before step 0, `preflight` compiles the step ahead of time, stops with a clear error if it
will not fit in device memory, and counts its FLOPs. Per step:

    time/step_s          end of step N-1 to end of step N on the device's timeline (host
                         stamps inside the program, `jaxrl.train.clock`), host stalls
                         included; without stamps (CPU default) between two metric fetches
    time/generate_s      prompts in -> rollout complete;  time/train_s: -> last update done
                         (with stamps: perf.phase_times)
    time/elapsed_s       since the first dispatch
    perf/tokens_per_s    completion tokens (sampled, the stop token included) / time/step_s
    perf/mfu, perf/hfu   the step's model / XLA FLOPs / (time/step_s x devices x peak)

With `train.target_reward` set, the summary says when the moving average of reward/mean over
TARGET_WINDOW steps first reached it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.config import RunDirError, to_yaml
from jaxrl.train.clock import step_seconds
from jaxrl.train.evaluate import evaluate
from jaxrl.train.experiment import ExperimentConfig
from jaxrl.train.metrics_log import (
    METRICS_FILE,
    PLOT_FILE,
    MetricsLog,
    moving_average,
    plot_rewards,
    summary_table,
    to_record,
)
from jaxrl.train.preflight import Preflight, preflight
from jaxrl.train.run import Run, build_run

__all__ = ["RunDirError", "train"]

TARGET_WINDOW = 20  # steps averaged when checking train.target_reward
FINAL_MODEL_DIR = "final_model"


def prepare_run_dir(cfg: ExperimentConfig, name: str) -> tuple[Path, bool]:
    """(the run directory, whether this call created it), refusing one that holds a run.

    An explicit `train.run_dir` may exist (empty, or left by a run that failed before its
    first step); a default one is `runs/<name>-<date>-<time>`, with a suffix when two runs
    start in the same second.
    """
    if cfg.train.run_dir:
        run_dir = Path(cfg.train.run_dir)
        if (run_dir / METRICS_FILE).exists():
            raise RunDirError(f"train.run_dir {str(run_dir)!r} already holds a run "
                              f"({METRICS_FILE}); choose a new train.run_dir")
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        stem = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        for suffix in ("", *(f"-{i}" for i in range(1, 1000))):
            run_dir = Path(stem + suffix)
            try:
                run_dir.mkdir(parents=True)
                break
            except FileExistsError:
                continue
        created = True
    (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    return run_dir, created


def train(cfg: ExperimentConfig, console: Console, *, name: str = "run") -> dict[str, Any]:
    """Runs the experiment `cfg`; returns the summary (also printed as a table).

    A failure while building (bad data, a model that does not fit the layout) removes the run
    directory again if this call created it; metrics already fetched are never lost.
    """
    start = time.perf_counter()
    run_dir, created = prepare_run_dir(cfg, name)
    console.print(f"[bold]run dir[/]: {run_dir}")
    try:
        run = build_run(cfg, run_dir, console)
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    key = jax.random.key(cfg.train.seed)
    first = run.place(next(run.batches))
    try:
        pre = preflight(run, (*first, jax.random.fold_in(key, 0)), console)
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    setup_s = time.perf_counter() - start
    log = MetricsLog(run_dir, tensorboard=cfg.log.tensorboard)
    try:
        train_s = _loop(cfg, run, pre, first, key, log, console)
        summary = _summary(cfg, run, pre, log.records, setup_s, train_s)
        if cfg.train.save_final:
            summary["final_model"] = str(run.save_policy(run_dir / FINAL_MODEL_DIR))
        if cfg.train.eval_prompts and run.task.eval_rows is not None:
            result = evaluate(run, cfg.train.eval_prompts, cfg.train.eval_batch_size,
                              seed=cfg.train.seed)
            summary.update(result)
            log.write_scalars(cfg.train.max_steps, result)
            (run_dir / "eval.json").write_text(
                json.dumps({"step": cfg.train.max_steps, **result}) + "\n", encoding="utf-8")
    finally:
        log.close()
    if cfg.log.plot and log.records:
        summary["plot"] = str(plot_rewards(log.records, run_dir / PLOT_FILE,
                                           title=f"{name}: {run.task.name}",
                                           target=cfg.train.target_reward))
    console.print(summary_table(summary))
    return summary


def _loop(cfg: ExperimentConfig, run: Run, pre: Preflight, first: tuple[Any, ...],
          key: jax.Array, log: MetricsLog, console: Console) -> float:
    """All steps (`first`: step 0's placed batch); returns the seconds from the first
    dispatch to the last metrics."""
    state = run.state
    progress = Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
        console=console, disable=not console.is_terminal)
    bar = progress.add_task("train", total=cfg.train.max_steps, status="compiling...")
    pending: tuple[int, dict[str, jax.Array]] | None = None
    last_fetch = start = time.perf_counter()
    last_end: float | None = None

    def record(step: int, metrics: dict[str, jax.Array]) -> None:
        nonlocal last_fetch, last_end
        host = jax.device_get(metrics)
        now = time.perf_counter()
        stamps = run.step.clock.pop()
        step_s = step_seconds(stamps, last_end)
        if step_s is None:  # no stamps: the interval between two fetches
            step_s = now - last_fetch
        last_fetch, last_end = now, stamps.get("end")
        host["time/step_s"] = step_s
        host["time/elapsed_s"] = now - start
        tokens = float(host["completion/len_mean"]) * run.rows
        host["perf/tokens_per_s"] = tokens / step_s
        host.update(pre.step_metrics(host, step_s, stamps))
        line = to_record(step, host)
        log.write(line)
        mfu = f"  MFU {line['perf/mfu']:.1%}" if "perf/mfu" in line else ""
        status = (f"reward {line['reward/mean']:.3f}  {step_s * 1e3:.0f} ms/step  "
                  f"{line['perf/tokens_per_s']:.0f} tok/s{mfu}")
        progress.update(bar, completed=step + 1, status=status)
        if not console.is_terminal and (step % cfg.log.print_every == 0
                                        or step == cfg.train.max_steps - 1):
            console.print(f"step {step + 1}/{cfg.train.max_steps}  {status}  "
                          f"({now - start:.0f}s)")

    with progress:
        try:
            for step in range(cfg.train.max_steps):
                placed = first if step == 0 else run.place(next(run.batches))
                state, metrics = run.step(state, *placed, jax.random.fold_in(key, step),
                                          run.ref_params)
                if pending is not None:
                    record(*pending)
                pending = (step, metrics)
        finally:
            # Step N-1's metrics are computed even when step N failed or was interrupted.
            if pending is not None and not _is_recorded(log, pending[0]):
                record(*pending)
    run.state = state
    return time.perf_counter() - start


def _is_recorded(log: MetricsLog, step: int) -> bool:
    return bool(log.records) and log.records[-1]["step"] == step


def _summary(cfg: ExperimentConfig, run: Run, pre: Preflight, records: list[dict[str, float]],
             setup_s: float, train_s: float) -> dict[str, Any]:
    """What the run did, for the table and the final JSON line (snake_case keys)."""
    rewards_N = np.array([r["reward/mean"] for r in records])
    later = records[1:] or records  # step 0 also pays first-run costs (allocation, caches)
    window = max(1, len(records) // 20)
    return {
        "run_dir": str(run.run_dir),
        "steps": len(records),
        "setup_s": setup_s,
        "train_s": train_s,
        "first_step_s": records[0]["time/step_s"],
        "median_step_s": float(np.median([r["time/step_s"] for r in later])),
        "tokens_per_s": float(np.median([r["perf/tokens_per_s"] for r in later])),
        **{f"{key}_median": float(np.median(values)) for key, values in (
            (key, [r[name] for r in later if name in r])
            for key, name in (("mfu", "perf/mfu"), ("hfu", "perf/hfu"),
                              ("generate_s", "time/generate_s"), ("train_s", "time/train_s")))
           if values},
        "peak_memory_bytes": pre.memory.peak_bytes if pre.memory.programs else None,
        "device_memory_bytes": pre.memory.limit_bytes or None,
        "step_compilations": run.step.num_compilations(),
        "reward_first": float(rewards_N[0]),
        "reward_last": float(rewards_N[-window:].mean()),
        "reward_last_window": window,
        "reward_best": float(rewards_N.max()),
        "prompts_dropped": run.batches.stats.num_dropped,
        **_target(cfg.train.target_reward, records),
    }


def _target(target: float | None, records: list[dict[str, float]]) -> dict[str, Any]:
    """When the moving average of reward/mean over TARGET_WINDOW steps first reached `target`."""
    if target is None:
        return {}
    average_N = moving_average([r["reward/mean"] for r in records], TARGET_WINDOW)
    hits = np.flatnonzero((average_N >= target) & (np.arange(len(records)) >= TARGET_WINDOW - 1))
    if not len(hits):
        return {"target_reward": target, "target_reached": False}
    first = records[int(hits[0])]
    return {"target_reward": target, "target_reached": True, "target_step": first["step"],
            "target_elapsed_s": first["time/elapsed_s"]}

