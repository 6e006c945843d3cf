"""Checkpoints of a training run: orbax's CheckpointManager under `<run_dir>/checkpoints/`.

A checkpoint named k is taken after k steps (steps 0..k-1 done) and holds four items:

    model      the policy's parameters (the TrainState's `model` part), each array sharded;
               with LoRA only the adapters (`nnx.LoRAParam`): the frozen base is referenced
               in `meta` by its directory and the SHA-256 of its weight files, and a run that
               loads another base is refused (`BaseMismatchError`) instead of resumed
    optimizer  the optimizer state: Adam moments, update counts, skip counters
    (critic, critic_optimizer: PPO's critic and its optimizer state, when the run has one)
    data       the prompt iterator and curriculum state (numpy arrays, `PromptBatches.state`)
    meta       JSON: the step, the run's base PRNG key, the jaxrl version

and an asynchronous run's (algo.mode=async) also `queue` and `queue_meta`: the batches made
but not yet trained on (`jaxrl.run.async_queue`).

Saves are asynchronous: `save` returns once the arrays are copied off the device (the next
step may donate them at once) and the files are written in a background thread; orbax writes
into a temporary directory and renames it when complete, so a process killed mid-save leaves
no checkpoint that looks whole. The last `keep` checkpoints are kept.

`restore` takes a *target*, the state of a freshly built run: every array comes back with the
target's sharding, so a run saved on one mesh layout resumes on another (the step programs
are compiled for exactly those shardings). `restore` (train's resume) and `restore_model`
(eval, export) read through one fallback:

    newest first      a checkpoint that fails to read (truncated, garbled or missing files) is
                      passed over for the one before it
    one is read       the newer ones that failed are moved aside, whole, to
                      <run_dir>/checkpoints_damaged/<step> (<step>-1, -2, ... when taken),
                      with a warning naming the step, its error and where it went: the step
                      can be saved again, and the next start does not trip over it
    none is read      RestoreError listing every step's error; nothing is moved (all of them
                      failing may as well mean a target that fits none, e.g. another model)
    explicit step     (eval/export --step N) never replaced by another: when it cannot be read,
                      a RestoreError names it and its error, and it stays where it is (one
                      checkpoint alone cannot tell damage from a target that does not fit)

A checkpoint is moved, never deleted, and only once an older one has been read into the same
target: that shows the target fits, so the failure is the newer checkpoint's own.

Several processes: every process writes and reads its own shards, and a restore ends in
orbax's barrier, so no process goes on before all have read their parts. A process that cannot
read its part cannot take the others back to an older checkpoint with it (they wait in that
barrier, and one process on another step than the others would mix two states): the run
stops with a RestoreError naming the checkpoint to remove, and the others exit when they lose
contact with it. So only a run of one process falls back and moves checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl import __version__
from jaxrl.distributed import is_lost_peer
from jaxrl.saved.files import CHECKPOINT_DIR, DAMAGED_CHECKPOINT_DIR

checkpoint_logger = logging.getLogger("jaxrl.checkpoint")
ReadT = TypeVar("ReadT")

# The TrainState's parts besides model and optimizer that a run may have (PPO's critic).
_CRITIC_ITEMS = ("critic", "critic_optimizer")

class RestoreError(RuntimeError):
    """No checkpoint of a run could be restored."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: `state` is the TrainState's nnx.State, sharded like the target."""

    step: int
    state: nnx.State
    data: dict[str, np.ndarray]
    meta: dict[str, Any]


def _abstract(tree: Any) -> Any:
    """Shape, dtype and sharding of every array of `tree`: the layout to restore into."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class BaseMismatchError(RestoreError):
    """A LoRA checkpoint whose adapters were trained on another base model."""


def base_reference(model_dir: str | Path) -> dict[str, str]:
    """{path, sha256} of an HF base model: the hash of its *.safetensors files' bytes, in
    name order (what the adapters of a LoRA checkpoint were trained on)."""
    model_dir = Path(model_dir).absolute()
    digest = hashlib.sha256()
    for file in sorted(model_dir.glob("*.safetensors")):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return {"path": str(model_dir), "sha256": digest.hexdigest()}


def _saved_model(model: nnx.State) -> nnx.State:
    """What a checkpoint holds of the policy: its adapters with LoRA, else all of it."""
    adapters = nnx.filter_state(model, nnx.LoRAParam)
    return adapters if jax.tree.leaves(adapters) else model


class Checkpoints:
    """The checkpoints of one run directory (module docstring). `base`: the LoRA base's
    `base_reference`, written into and checked against each checkpoint's meta."""

    def __init__(self, run_dir: str | Path, *, keep: int | None = 3, async_save: bool = True,
                 base: dict[str, str] | None = None):
        self.base = base
        self.directory = (Path(run_dir) / CHECKPOINT_DIR).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: nnx.State, data: dict[str, np.ndarray],
             key: jax.Array, queue: tuple[dict[str, Any], dict[str, Any]] | None = None
             ) -> None:
        """Starts saving checkpoint `step`: returns once `state` may be donated. `data` (the
        iterator's state) must not be empty. `queue`: (arrays, JSON) of the asynchronous
        step's untrained batches (`jaxrl.run.async_queue`), saved as two more items."""
        if not data:
            raise ValueError("a checkpoint needs the prompt iterator's state; got no arrays")
        meta = {"step": int(step), "key": np.asarray(jax.random.key_data(key)).tolist(),
                "key_impl": str(jax.random.key_impl(key)), "jaxrl_version": __version__}
        model = _saved_model(state["model"])
        if model is not state["model"] and self.base is not None:
            meta["base_model"] = self.base
        items = dict(
            model=ocp.args.StandardSave(nnx.to_pure_dict(model)),
            optimizer=ocp.args.StandardSave(nnx.to_pure_dict(state["optimizer"])),
            data=ocp.args.StandardSave(data),
            meta=ocp.args.JsonSave(meta))
        for name in _CRITIC_ITEMS:
            if name in state:
                items[name] = ocp.args.StandardSave(nnx.to_pure_dict(state[name]))
        if queue is not None:
            arrays, queue_meta = queue
            items["queue_meta"] = ocp.args.JsonSave(queue_meta)
            if arrays:
                items["queue"] = ocp.args.StandardSave(arrays)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore_queue(self, step: int, target: dict[str, Any] | None
                      ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(arrays into the layout of `target`, JSON) of checkpoint `step`'s queue items
        (`save`); (None, {}) when it has none. `target` None: only the JSON is read."""
        if not (self.directory / str(step) / "queue_meta").exists():
            return None, {}
        items = dict(queue_meta=ocp.args.JsonRestore())
        if target:
            items["queue"] = ocp.args.StandardRestore(_abstract(target))
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        return (out.queue if target else None), dict(out.queue_meta)

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def restore(self, target: nnx.State, step: int | None = None) -> Restored | None:
        """The checkpoint `step` (default: the newest readable one, module docstring) into
        the layout of `target`; None when there is none."""
        return self._read(functools.partial(self._restore, target=target), step)

    def restore_model(self, target: nnx.State, step: int | None = None) -> tuple[int, nnx.State]:
        """(step, the policy's parameters) of checkpoint `step` (default: the newest readable
        one) into the layout of `target` (a model's nnx.State): export and evaluation need no
        more."""
        args = ocp.args.Composite(
            model=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(_saved_model(target)))),
            meta=ocp.args.JsonRestore())

        def read(at: int) -> tuple[int, nnx.State]:
            state = jax.tree.map(lambda x: x, target)
            out = self._manager.restore(at, args=args)
            self._check_base(at, dict(out.meta))
            nnx.replace_by_pure_dict(state, out.model)
            return at, state

        found = self._read(read, step)
        if found is None:
            raise RestoreError(f"no checkpoints in {self.directory}")
        return found

    def _read(self, read: Callable[[int], ReadT], step: int | None) -> ReadT | None:
        """`read(step)`, or `read` of the newest checkpoint it succeeds on, moving the newer
        ones aside (module docstring); None when there are no checkpoints."""
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise RestoreError(f"no checkpoint at step {step} in {self.directory}; it has "
                                   f"{steps or 'none'}")
            try:
                return self._only(step, read)
            except Exception as e:
                if isinstance(e, RestoreError) or is_lost_peer(e):
                    raise
                raise RestoreError(
                    f"checkpoint {step} in {self.directory} cannot be read ({_why(e)}); it was "
                    f"left in place (a step asked for is never replaced by another: ask for none "
                    f"to use the newest readable checkpoint)") from e
        failed: list[tuple[int, Exception]] = []
        for candidate in reversed(steps):
            try:
                found = self._only(candidate, read)
            except Exception as e:  # orbax/tensorstore raise many kinds on damaged files
                if isinstance(e, RestoreError) or is_lost_peer(e):
                    raise  # (lost peer: not this checkpoint's fault, another process is gone)
                failed.append((candidate, e))
                continue
            for bad, error in failed:
                self._move_aside(bad, error, candidate)
            return found
        if failed:
            raise RestoreError(
                f"no checkpoint in {self.directory} could be read (none was moved: when every "
                f"one fails, the cause may be the model read into, e.g. another config):\n  "
                + "\n  ".join(f"step {bad}: {_why(error)}" for bad, error in failed))
        return None

    def _only(self, step: int, read: Callable[[int], ReadT]) -> ReadT:
        """`read(step)`; with several processes a failure is a RestoreError (no fallback)."""
        try:
            return read(step)
        except Exception as e:
            if jax.process_count() == 1 or is_lost_peer(e):
                raise  # (another process failed; this one only lost contact with it)
            raise RestoreError(
                f"process {jax.process_index()} cannot read its part of checkpoint {step} in "
                f"{self.directory} ({_why(e)}); the processes of a run cannot fall back "
                f"together: remove {self.directory / str(step)} to resume from the checkpoint "
                f"before it") from e

    def _move_aside(self, step: int, error: Exception, used: int) -> None:
        """Moves unreadable checkpoint `step` to the damaged folder, with a warning."""
        damaged = self.directory.parent / DAMAGED_CHECKPOINT_DIR
        destination = damaged / str(step)
        for i in range(1, 1000):
            if not destination.exists():
                break
            destination = damaged / f"{step}-{i}"
        try:
            damaged.mkdir(exist_ok=True)
            (self.directory / str(step)).rename(destination)
            moved = f"moved it to {destination}"
        except OSError as e:
            moved = (f"it could not be moved to {destination} ({_why(e)}): remove it before "
                     f"step {step} is saved again")
        self._manager.reload()
        checkpoint_logger.warning(
            "checkpoint %d in %s cannot be read: %s; fell back to checkpoint %d (%s)",
            step, self.directory, moved, used, _why(error))

    def _check_base(self, step: int, meta: dict[str, Any]) -> None:
        """Refuses a LoRA checkpoint trained on another base than `self.base`."""
        saved = meta.get("base_model")
        if saved is None or self.base is None or saved["sha256"] == self.base["sha256"]:
            return
        raise BaseMismatchError(
            f"checkpoint {step} in {self.directory} holds LoRA adapters trained on the base "
            f"model {saved['path']} (weights sha256 {saved['sha256'][:16]}...), but this run "
            f"loads {self.base['path']} (sha256 {self.base['sha256'][:16]}...): adapters "
            f"only apply to their own base; set model.path to that base or start a new run")

    def _restore(self, step: int, target: nnx.State) -> Restored:
        model, optimizer = _saved_model(target["model"]), target["optimizer"]
        critic = {name: ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(target[name])))
                  for name in _CRITIC_ITEMS if name in target}
        out = self._manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(model))),
            optimizer=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(optimizer))),
            data=ocp.args.StandardRestore(),
            meta=ocp.args.JsonRestore(), **critic))
        self._check_base(step, dict(out.meta))
        state = jax.tree.map(lambda x: x, target)  # a new State of the same structure
        nnx.replace_by_pure_dict(state["model"], out.model)  # (LoRA: the adapters only)
        nnx.replace_by_pure_dict(state["optimizer"], out.optimizer)
        for name in critic:
            nnx.replace_by_pure_dict(state[name], out[name])
        data = {k: np.asarray(v) for k, v in out.data.items()}
        return Restored(step, state, data, dict(out.meta))


def _why(e: BaseException) -> str:
    """`e` in one line of at most ~300 characters, for a warning or an error message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def restore_key(meta: dict[str, Any]) -> jax.Array:
    """The run's base PRNG key saved in a checkpoint's meta."""
    return jax.random.wrap_key_data(np.asarray(meta["key"], np.uint32), impl=meta["key_impl"])


def restore_policy(run_dir: str | Path, state: nnx.State, step: int | None = None
                   ) -> tuple[int | None, nnx.State]:
    """(its step, `state` with the policy of checkpoint `step` (default: the newest readable
    one, module docstring) of `run_dir`); (None, `state`) when the run has no checkpoints."""
    checkpoints = Checkpoints(run_dir, async_save=False)
    try:
        if not checkpoints.steps():
            return None, state
        step, model = checkpoints.restore_model(state["model"], step)
    finally:
        checkpoints.close()
    state = jax.tree.map(lambda x: x, state)  # a new State: the caller's stays as it was
    state["model"] = model
    return step, state
