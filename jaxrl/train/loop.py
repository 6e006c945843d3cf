"""The training loop: build a run from its config, step it, log it, checkpoint it, evaluate it.

    run = build_run(cfg, run_dir, console)   mesh, tokenizer, policy, task, prompts, step
    restore the newest checkpoint            when the run dir has one (`run_dir.py`)
    for step in range(start, max_steps):
        dispatch step N                  (returns at once: JAX runs it asynchronously)
        fetch step N-1's metrics         the device already works on N while the host logs;
                                         the curriculum observes each prompt's success
        every train.checkpoint_every steps, on SIGTERM and at the end: fetch step N's
        metrics and save a checkpoint (asynchronous: the next step starts at once)
        every eval.every steps: evaluate
    save the final policy, evaluate on held-out prompts, plot, print the summary

The host never waits on the device inside the loop except to fetch metrics one step late
(nanodo's pattern), so host work (next batch, logging) overlaps device work.

Several processes run this same loop in lockstep, each on its own rows of every batch; the
metrics are global (every process fetches the same values), and only process 0 writes
them, the plot and the evaluations; every process writes its checkpoint shards.

Resuming is exact: step N's prompts come from the restored iterator, its key is
fold_in(key, N) of the restored base key, the curriculum sees step j's results only when
drawing step j + 2 (whenever they were fetched), and the train state comes back bit for bit;
a resumed run's metrics equal an uninterrupted run's (timings aside).

Faults: an update whose loss or gradient is not finite is skipped in the program
(`train_on`); after `train.max_skipped_in_a_row` such steps in a row the run stops with
`NonFiniteError` (its metrics written, no checkpoint of the diverged state). SIGTERM
(`preemption.py`) ends the run after the step in flight with a checkpoint, exit status 0.

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

import shutil
import time
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxrl.config import RunDirError
from jaxrl.distributed import is_main
from jaxrl.train.checkpoint import Checkpoints, restore_key
from jaxrl.train.clock import step_seconds
from jaxrl.train.evaluate import Evaluator, append_eval
from jaxrl.train.experiment import ExperimentConfig
from jaxrl.train.metrics_log import (
    PLOT_FILE,
    MetricsLog,
    moving_average,
    plot_rewards,
    summary_table,
    to_record,
)
from jaxrl.train.preemption import StopRequest
from jaxrl.train.preflight import Preflight, preflight
from jaxrl.train.run import Run, build_run
from jaxrl.train.run_dir import prepare_run_dir
from jaxrl.train.step import SIGNAL_KEY, SUCCESS_KEY

__all__ = ["NonFiniteError", "RunDirError", "train"]

TARGET_WINDOW = 20  # steps averaged when checking train.target_reward
FINAL_MODEL_DIR = "final_model"


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient: the run stopped."""


def train(cfg: ExperimentConfig, console: Console, *, name: str = "run") -> dict[str, Any]:
    """Runs (or resumes) the experiment `cfg`; returns the summary (also printed as a table).

    A failure while building (bad data, a model that does not fit the layout) removes the run
    directory again if this call created it; metrics already fetched are never lost.
    """
    start = time.perf_counter()
    run_dir, created, resume = prepare_run_dir(cfg, name)
    console.print(f"[bold]run dir[/]: {run_dir}")
    checkpoints = Checkpoints(run_dir, keep=cfg.train.keep_checkpoints)
    try:
        with StopRequest() as stop:
            try:
                run = build_run(cfg, run_dir, console, reuse_init=resume)
                key, start_step = jax.random.key(cfg.train.seed), 0
                if resume:
                    key, start_step = _resume(cfg, run, checkpoints, console)
                batch = next(run.batches)
                first = (batch, run.place(batch))
                pre = preflight(run, (*first[1], jax.random.fold_in(key, start_step)), console)
            except BaseException:
                if created:
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
            setup_s = time.perf_counter() - start
            log = MetricsLog(run_dir, tensorboard=cfg.log.tensorboard,
                             resume_at=start_step if resume else None)
            try:
                train_s, stopped = _loop(cfg, run, pre, first, key, start_step, log,
                                         checkpoints, stop, console)
                summary = _summary(cfg, run, pre, log.records, setup_s, train_s)
                if stopped is not None:
                    summary["stopped_by"] = stop.signal
                    summary["checkpoint_step"] = stopped
                    console.print(f"[bold yellow]{stop.signal}[/]: stopped after step {stopped} "
                                  f"with a checkpoint; run the same command to resume")
                else:
                    _finish(cfg, run, log, summary)
            finally:
                log.close()
    finally:
        checkpoints.wait()
        checkpoints.close()
    if cfg.log.plot and log.records and is_main():
        summary["plot"] = str(plot_rewards(log.records, run_dir / PLOT_FILE,
                                           title=f"{name}: {run.task.name}",
                                           target=cfg.train.target_reward))
    console.print(summary_table(summary))
    return summary


def _resume(cfg: ExperimentConfig, run: Run, checkpoints: Checkpoints,
            console: Console) -> tuple[jax.Array, int]:
    """Loads the newest readable checkpoint into `run`; (base key, the step to run next)."""
    restored = checkpoints.restore(run.state)
    if restored.step >= cfg.train.max_steps:
        raise RunDirError(f"train.run_dir {str(run.run_dir)!r} is finished: its checkpoint is at "
                          f"step {restored.step} and train.max_steps={cfg.train.max_steps}; raise "
                          f"train.max_steps to train further, or choose a new train.run_dir")
    run.state = restored.state
    run.batches.restore(restored.data)
    console.print(f"[bold]resume[/]: from the checkpoint at step {restored.step}")
    return restore_key(restored.meta), restored.step


def _finish(cfg: ExperimentConfig, run: Run, log: MetricsLog, summary: dict[str, Any]) -> None:
    """After the last step: the final policy in HF format, the final evaluation."""
    if cfg.train.save_final:
        summary["final_model"] = str(run.save_policy(run.run_dir / FINAL_MODEL_DIR))
    if cfg.eval.num_prompts and run.task.eval_rows is not None:
        result = Evaluator(run, cfg.eval)()
        summary.update(result)
        log.write_scalars(cfg.train.max_steps, result)
        append_eval(run.run_dir, cfg.train.max_steps, result)


def _loop(cfg: ExperimentConfig, run: Run, pre: Preflight, first: tuple[Any, Any],
          key: jax.Array, start_step: int, log: MetricsLog, checkpoints: Checkpoints,
          stop: StopRequest, console: Console) -> tuple[float, int | None]:
    """Steps `start_step`.. (`first`: the first step's batch, host and placed); returns the
    seconds from the first dispatch to the last metrics, and the step a stop signal ended
    the run after (None: it ran to train.max_steps)."""
    state = run.state
    max_steps, every = cfg.train.max_steps, cfg.train.checkpoint_every
    progress = Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
        console=console, disable=not console.is_terminal)
    bar = progress.add_task("train", total=max_steps, completed=start_step,
                            status="compiling...")
    pending: tuple[int, dict[str, jax.Array]] | None = None
    # Each step's prompt positions (for the curriculum) and data metrics, taken at its draw.
    drawn: dict[int, tuple[Any, dict[str, float]]] = {}
    last_fetch = start = time.perf_counter()
    last_end: float | None = None
    evaluator: Evaluator | None = None

    def record(step: int, metrics: dict[str, jax.Array]) -> None:
        nonlocal last_fetch, last_end
        host = jax.device_get(metrics)
        now = time.perf_counter()
        positions_B, data_metrics = drawn.pop(step)
        run.batches.observe(step, positions_B, host.pop(SUCCESS_KEY), host.pop(SIGNAL_KEY))
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
        host.update(data_metrics)
        line = to_record(step, host)
        log.write(line)
        mfu = f"  MFU {line['perf/mfu']:.1%}" if "perf/mfu" in line else ""
        status = (f"reward {line['reward/mean']:.3f}  {step_s * 1e3:.0f} ms/step  "
                  f"{line['perf/tokens_per_s']:.0f} tok/s{mfu}")
        progress.update(bar, completed=step + 1, status=status)
        if not console.is_terminal and (step % cfg.log.print_every == 0
                                        or step == max_steps - 1):
            console.print(f"step {step + 1}/{max_steps}  {status}  ({now - start:.0f}s)")
        if line["train/skipped_in_a_row"] >= cfg.train.max_skipped_in_a_row:
            raise NonFiniteError(
                f"step {step}: {int(line['train/skipped_in_a_row'])} steps in a row had a "
                f"non-finite loss or gradient (their updates were skipped; "
                f"train.max_skipped_in_a_row={cfg.train.max_skipped_in_a_row}); lower optim.lr, "
                f"keep optim.max_grad_norm on, check the rewards for NaN, or resume from an "
                f"earlier checkpoint")

    stopped = None
    with progress:
        try:
            for step in range(start_step, max_steps):
                batch, placed = first if step == start_step else (
                    (b := next(run.batches)), run.place(b))
                drawn[step] = (batch.all_positions_B, run.batches.metrics())
                state, metrics = run.step(state, *placed, jax.random.fold_in(key, step),
                                          run.ref_params)
                if pending is not None:
                    record(*pending)
                pending = (step, metrics)
                done = step + 1
                stopping = stop.requested(step)
                save = stopping or (every > 0 and (done % every == 0 or done == max_steps))
                evaluate_now = (cfg.eval.every > 0 and done % cfg.eval.every == 0
                                and done < max_steps and cfg.eval.num_prompts > 0
                                and run.task.eval_rows is not None)
                if save or evaluate_now:
                    record(*pending)  # a checkpoint holds the curriculum's view of this step
                    pending = None
                if save:
                    checkpoints.save(done, state, run.batches.state(), key)
                if evaluate_now:
                    run.state = state
                    evaluator = evaluator or Evaluator(run, cfg.eval)
                    result = evaluator()
                    log.write_scalars(done, result)
                    append_eval(run.run_dir, done, result)
                if stopping:
                    stopped = done
                    break
        finally:
            # Step N-1's metrics are computed even when step N failed or was interrupted.
            if pending is not None and not _is_recorded(log, pending[0]):
                record(*pending)
    run.state = state
    return time.perf_counter() - start, stopped


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

