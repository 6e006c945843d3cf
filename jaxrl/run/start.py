"""Starting a run, shared by `jaxrl train` and `jaxrl bench`: the run directory, the built run,
its state (restored when resuming), the first batch and the preflight.

    started = start_run(cfg, name, console, resumable=True)
        prepare_run_dir      a new run directory, or the same one to resume (run_dir.py)
        build_run            mesh, tokenizer, policy, task, prompts, step (build.py)
        restore              the newest readable checkpoint, when resuming (checkpoint.py),
                             with an async run's batches made ahead (async_queue.py)
        first batch          drawn and placed on the mesh
        preflight            compile, memory fit, FLOP count (preflight.py)

A failure before the first step (bad data, a model that does not fit, Ctrl-C) undoes the
claim of a new run directory: the folder this call made goes, an empty one it claimed is
emptied again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from flax import nnx
from rich.console import Console

from jaxrl.config import ExperimentConfig, RunDirError
from jaxrl.data.prompts import PromptBatch
from jaxrl.run.async_queue import queue_entries, restore_queue
from jaxrl.run.build import Run, build_run
from jaxrl.run.placement import Placed
from jaxrl.run.preflight import Preflight, preflight
from jaxrl.run.run_dir import prepare_run_dir
from jaxrl.saved.checkpoint import Checkpoints, base_reference, restore_key
from jaxrl.saved.files import INIT_MODEL_DIR


@dataclasses.dataclass(frozen=True)
class Started:
    """A run ready for its first step (`start_step`: 0, or the checkpoint's step). `state` is
    the state to start from: the first step donates it, and the loop carries the new one."""

    run: Run
    state: nnx.State
    key: jax.Array  # the run's base key; step N runs with fold_in(key, N)
    start_step: int
    resumed: bool
    first: tuple[PromptBatch, Placed]  # the first batch drawn, on the host and placed
    pre: Preflight
    setup_s: float
    checkpoints: Checkpoints | None  # the run's (train); None for bench
    # An async run resumed with batches already made (`async_queue`): their draws. The first
    # batch drawn is then that many steps past start_step.
    drawn: dict[int, tuple[Any, dict[str, float]]] = dataclasses.field(default_factory=dict)

    def batch(self, step: int) -> tuple[PromptBatch, Placed]:
        """Step `step`'s batch (host, placed): the prepared one first, then the next ones."""
        if step == self.start_step + len(self.drawn):
            return self.first
        batch = next(self.run.batches)
        return batch, self.run.place(batch)


def start_run(cfg: ExperimentConfig, name: str, console: Console, *, resumable: bool = True,
              refresh_peak: bool = False) -> Started:
    """Everything up to the first step (module docstring). `resumable`: the run saves
    checkpoints and resumes from them (train); otherwise a run directory holding
    checkpoints is refused (`jaxrl bench` measures new runs only)."""
    start = time.perf_counter()
    claim = prepare_run_dir(cfg, name)
    run_dir, resume = claim.run_dir, claim.resume
    if resume and not resumable:
        raise RunDirError(f"train.run_dir {str(run_dir)!r} holds a run with checkpoints; "
                          f"choose a new train.run_dir")
    console.print(f"[bold]run dir[/]: {run_dir}")
    if claim.note:
        console.print(f"[yellow]run dir[/]: {claim.note}")
    checkpoints = Checkpoints(run_dir, keep=cfg.train.keep_checkpoints) if resumable else None
    try:
        run, state = build_run(cfg, run_dir, console, reuse_init=resume)
        if checkpoints is not None and cfg.model.lora is not None:
            checkpoints.base = base_reference(cfg.model.path or run_dir / INIT_MODEL_DIR)
        key, start_step, queued = jax.random.key(cfg.train.seed), 0, []
        if resume:
            state, key, start_step = _resume(run, state, checkpoints, console)
            queued = queue_entries(checkpoints, start_step)
        batch = next(run.batches)
        first = (batch, run.place(batch))
        args = (*first[1], jax.random.fold_in(key, start_step + len(queued)))
        drawn = {}
        if queued:
            if run.queue is None:
                raise RunDirError(f"train.run_dir {str(run.run_dir)!r} holds an algo.mode=async "
                                  f"checkpoint with {len(queued)} batches made ahead; resume "
                                  f"it with algo.mode=async")
            pending, drawn = restore_queue(checkpoints, start_step, queued,
                                           run.queue.abstract_entries(
                                               run.step.policy_params(state), *args))
            run.queue.resume_with(pending, start_step + len(queued))
            console.print(f"[bold]resume[/]: {len(queued)} batches made before the checkpoint "
                          f"(steps {pending[0].step}..{pending[-1].step}) restored")
        pre = preflight(run, state, args, console, refresh_peak=refresh_peak)
    except BaseException:
        if checkpoints is not None:
            checkpoints.close()
        claim.release()
        raise
    return Started(run, state, key, start_step, resume, first, pre,
                   time.perf_counter() - start, checkpoints, drawn)


def _resume(run: Run, state: nnx.State, checkpoints: Checkpoints, console: Console
            ) -> tuple[nnx.State, jax.Array, int]:
    """(restored state, base key, the step to run next) from the newest readable checkpoint;
    the prompt iterator is restored in place."""
    restored = checkpoints.restore(state)
    max_steps = run.cfg.train.max_steps
    if restored.step >= max_steps:
        raise RunDirError(f"train.run_dir {str(run.run_dir)!r} is finished: its checkpoint is at "
                          f"step {restored.step} and train.max_steps={max_steps}; raise "
                          f"train.max_steps to train further, or choose a new train.run_dir")
    run.batches.restore(restored.data)
    console.print(f"[bold]resume[/]: from the checkpoint at step {restored.step}")
    return restored.state, restore_key(restored.meta), restored.step
