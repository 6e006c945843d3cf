"""The training loop: build a run from its config, step it, log it, checkpoint it, evaluate it.

    started = start_run(cfg, ...)    run dir, run, state (restored when resuming), preflight
    for step in range(start, max_steps):
        state, out = step(state, ...)    dispatch step N (returns at once: JAX runs it
                                         asynchronously; the state is donated and returned)
        record step N-1                  the device already works on N while the host logs;
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
a resumed run's metrics equal an uninterrupted run's (timings aside). An async run
(algo.mode=async) also saves the batches it made ahead and trains them on resume
(`async_queue.py`).

Faults: an update whose loss or gradient is not finite is skipped in the program
(`train_on`); after `train.max_skipped_in_a_row` such steps in a row the run stops with
`NonFiniteError` (its metrics written, no checkpoint of the diverged state). A step *fails
its rewards* when some reward failed (raised, or returned a non-number or a value outside its
bounds: `jaxrl.rl.rewards`) on more than `train.reward_error_frac` of the step's samples
(reward/errors/<name> / (data.batch_size × rollout.num_generations)); after
`train.reward_error_steps` such steps in a row the run stops with `RewardFailureError`, whose
message holds that reward's first error (its metrics written; the count restarts on resume).
SIGTERM (`preemption.py`) ends the run after the step in flight with a checkpoint, exit
status 0.

Before step 0, `preflight` compiles the step, checks its memory fit and counts its FLOPs;
each step's record is made by `StepRecorder` (`recorder.py`, which defines its time/* and
perf/* metrics). Progress lines show means over the steps since the previous line
(`progress.py`); the end-of-run summary is `summary.py`'s.
"""

from __future__ import annotations

import time
from typing import Any

import jax
from flax import nnx
from rich.console import Console

from jaxrl.config import ExperimentConfig
from jaxrl.distributed import is_main
from jaxrl.run import progress
from jaxrl.run.async_queue import queue_checkpoint
from jaxrl.run.build import policy, save_policy
from jaxrl.run.evaluate import Evaluator, append_eval
from jaxrl.run.metrics_log import MetricsLog, plot_rewards, summary_table
from jaxrl.run.preemption import StopRequest
from jaxrl.run.recorder import StepRecorder
from jaxrl.run.start import Started, start_run
from jaxrl.run.summary import run_summary
from jaxrl.saved.files import FINAL_MODEL_DIR, PLOT_FILE
from jaxrl.step.asynchronous import AsyncStep

__all__ = ["NonFiniteError", "RewardFailureError", "TrainingStopped", "train"]


class TrainingStopped(RuntimeError):
    """The run stopped on a fault of the training itself (its metrics are written); the
    command exits with status 1 and this message."""


class NonFiniteError(TrainingStopped):
    """Too many steps in a row had a non-finite loss or gradient: the run stopped."""


class RewardFailureError(TrainingStopped):
    """A reward failed on too many samples for too many steps in a row: the run stopped."""


def train(cfg: ExperimentConfig, console: Console, *, name: str = "run") -> dict[str, Any]:
    """Runs (or resumes) the experiment `cfg`; returns the summary (also printed as a table).

    Metrics already fetched are never lost; a failure before step 0 leaves no new run
    directory behind (`start_run`).
    """
    with StopRequest() as stop:
        started = start_run(cfg, name, console)
        checkpoints = started.checkpoints
        try:
            log = MetricsLog(started.run.run_dir, tensorboard=cfg.log.tensorboard,
                             resume_at=started.start_step if started.resumed else None)
            try:
                state, train_s, stopped = _loop(cfg, started, log, stop, console)
                summary = run_summary(started, log.records, train_s)
                if stopped is not None:
                    summary["stopped_by"] = stop.signal
                    summary["checkpoint_step"] = stopped
                    console.print(f"[bold yellow]{stop.signal}[/]: stopped after step {stopped} "
                                  f"with a checkpoint ({checkpoints.directory / str(stopped)}); "
                                  f"run the same command to resume")
                else:
                    _finish(cfg, started, state, log, summary)
            finally:
                log.close()
        finally:
            checkpoints.wait()
            checkpoints.close()
    run = started.run
    if cfg.log.plot and log.records and is_main():
        summary["plot"] = str(plot_rewards(log.records, run.run_dir / PLOT_FILE,
                                           title=f"{name}: {run.task.name}",
                                           target=cfg.train.target_reward))
    console.print(summary_table(summary))
    return summary


def _finish(cfg: ExperimentConfig, started: Started, state: nnx.State, log: MetricsLog,
            summary: dict[str, Any]) -> None:
    """After the last step: the final policy in HF format, the final evaluation."""
    run = started.run
    if cfg.train.save_final:
        summary["final_model"] = str(save_policy(run, state, run.run_dir / FINAL_MODEL_DIR))
    if cfg.eval.num_prompts and run.task.eval_rows is not None:
        result = Evaluator(run, cfg.eval)(policy(run.step, state)[1])
        summary.update(result)
        log.write_scalars(cfg.train.max_steps, result)
        append_eval(run.run_dir, cfg.train.max_steps, result)


def _loop(cfg: ExperimentConfig, started: Started, log: MetricsLog, stop: StopRequest,
          console: Console) -> tuple[nnx.State, float, int | None]:
    """Steps from `started.start_step`; returns the final state, the seconds from the first
    dispatch to the last metrics, and the step a stop signal ended the run after (None: it
    ran to train.max_steps)."""
    run, state, checkpoints = started.run, started.state, started.checkpoints
    max_steps, every = cfg.train.max_steps, cfg.train.checkpoint_every
    bar = progress.ProgressBar(console, max_steps, started.start_step, cfg.log.print_every)
    recorder = StepRecorder(run, started.pre, log)
    pending: tuple[int, Any] | None = None
    # Each step's prompt positions (for the curriculum) and data metrics, taken at its draw.
    drawn: dict[int, tuple[Any, dict[str, float]]] = dict(started.drawn)
    evaluator: Evaluator | None = None
    rewards = run.step.rewards
    if isinstance(run.step, AsyncStep) and jax.process_count() == 1:
        # A stop ends the fill of the queue of batches made ahead (AsyncStep) too: with a
        # large algo.max_staleness that fill is most of the run's first step. (With several
        # processes each fills alike; their stop comes from JAX's agreement, after a step.)
        run.step.stop_requested = lambda: stop.signal is not None
    failing = 0  # steps in a row that failed their rewards
    attempted = -1  # the last step whose record was begun

    def record(step: int, out: Any) -> None:
        nonlocal failing, attempted
        attempted = step
        line = recorder.record(step, out, *drawn[step])
        del drawn[step]
        bar.add(line)
        rewards.observe(step, line)
        fraction, name = max((line.get(f"reward/errors/{r.name}", 0.0) / run.rows, r.name)
                             for r in rewards.rewards)
        failing = failing + 1 if fraction > cfg.train.reward_error_frac else 0
        if failing >= cfg.train.reward_error_steps:
            first = rewards.errors.get(name) or (f"reward {name!r} failed on the rows of "
                                                 f"another process: see its log")
            raise RewardFailureError(
                f"step {step}: reward {name!r} failed on {fraction:.0%} of the step's samples, "
                f"more than train.reward_error_frac={cfg.train.reward_error_frac}, "
                f"{failing} steps in a row (train.reward_error_steps="
                f"{cfg.train.reward_error_steps}); its first error: {first}")
        if line["train/skipped_in_a_row"] >= cfg.train.max_skipped_in_a_row:
            raise NonFiniteError(
                f"step {step}: {int(line['train/skipped_in_a_row'])} steps in a row had a "
                f"non-finite loss or gradient (their updates were skipped; "
                f"train.max_skipped_in_a_row={cfg.train.max_skipped_in_a_row}); lower optim.lr, "
                f"keep optim.max_grad_norm on, check the rewards for NaN, or resume from an "
                f"earlier checkpoint")

    def batch_of(step: int) -> tuple[Any, ...]:
        """Step `step`'s device arguments, its draw noted for the curriculum (async mode
        draws max_staleness steps ahead)."""
        batch, placed = started.batch(step)
        drawn[step] = (batch.all_positions_B, run.batches.metrics())
        return (*placed, jax.random.fold_in(started.key, step))

    stopped = None
    with bar:
        try:
            for step in range(started.start_step, max_steps):
                state, out = run.step.step_at(state, step, batch_of, run.ref_params)
                if pending is not None:
                    record(*pending)
                pending = (step, out)
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
                    checkpoints.save(done, state, run.batches.state(), started.key,
                                     queue=queue_checkpoint(run.step, drawn)
                                     if isinstance(run.step, AsyncStep) else None)
                if evaluate_now:
                    evaluator = evaluator or Evaluator(run, cfg.eval)
                    result = evaluator(policy(run.step, state)[1])
                    log.write_scalars(done, result)
                    append_eval(run.run_dir, done, result)
                if stopping:
                    stopped = done
                    break
        finally:
            # Step N-1's metrics are recorded even when step N failed or was interrupted; not
            # again when its own record failed (a full disk: the curriculum has seen it, and
            # the error in flight is the one to report).
            if pending is not None and attempted != pending[0]:
                record(*pending)
    return state, time.perf_counter() - recorder.start, stopped
