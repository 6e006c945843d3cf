"""`jaxrl train`: start a run from its config, step it with its hooks, finish it.

    started = start_run(cfg, ...)    run dir, run, state (restored when resuming), preflight
    Trainer(started, recorder, train_hooks(...)).run_steps()
                                     each step dispatched, its record made one step late
                                     (`jaxrl.run.trainer`) and handed to the hooks
                                     (`jaxrl.run.hooks`): preemption, curriculum, progress,
                                     the reward and non-finite guards, checkpoint, evaluation
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

Faults (`hooks/guards.py`): too many non-finite updates or failed rewards in a row stop the
run with its metrics written and no checkpoint of the failing state. SIGTERM (`preemption.py`)
ends the run after the step in flight with a checkpoint, exit status 0.

Before step 0, `preflight` compiles the step, checks its memory fit and counts its FLOPs;
each step's record is made by `StepRecorder` (`recorder.py`, which defines its time/* and
perf/* metrics). Progress lines show means over the steps since the previous line
(`progress.py`); the end-of-run summary is `summary.py`'s.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from rich.console import Console

from jaxrl.config import ExperimentConfig
from jaxrl.distributed import is_main
from jaxrl.run.build import policy, save_policy
from jaxrl.run.evaluate import Evaluator, append_eval
from jaxrl.run.hooks import NonFiniteError, RewardFailureError, TrainingStopped, train_hooks
from jaxrl.run.metrics_log import MetricsLog, plot_rewards, summary_table
from jaxrl.run.preemption import StopRequest
from jaxrl.run.recorder import StepRecorder
from jaxrl.run.start import Started, start_run
from jaxrl.run.summary import run_summary
from jaxrl.run.trainer import Trainer
from jaxrl.saved.files import FINAL_MODEL_DIR, PLOT_FILE

__all__ = ["NonFiniteError", "RewardFailureError", "TrainingStopped", "train"]


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
    trainer = Trainer(started, StepRecorder(started.run, started.pre, log),
                      train_hooks(cfg, started, stop, console), cfg.train.max_steps)
    trainer.run_steps()
    return trainer.state, trainer.seconds, trainer.stopped
