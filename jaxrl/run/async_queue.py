"""An asynchronous run's queue in its checkpoints: the batches made but not yet trained on.

    arrays, meta = queue_checkpoint(run.step, drawn)         at a checkpoint after step n
    entries = queue_entries(checkpoints, n + 1)                              on resume
    pending, drawn = restore_queue(checkpoints, n + 1, entries, abstract)

With `algo.max_staleness` k, once step n is done the rollout side has already made batches
n+1..n+k, each from weights older than the checkpoint's (after n+1-k..n updates). They are
*saved*, not regenerated: regenerating them would need the k older weight versions that made
them, each as large as the policy, while a batch of rollouts is a few token arrays. Saved per
batch: its rollout and reward inputs (the `queue` item, one entry per leaf) and, as JSON
(`queue_meta`), its step, the weight version it was made from and what the loop noted at its
draw (the prompt positions the curriculum observes, the data metrics). With in-flight
weight updates (`rollout.inflight_updates`) the batches still being generated are saved as
they stand between two pieces (`jaxrl.rollout.inflight.Partial`: the KV pool, the slots,
the tokens so far and the version of each) and go on from there, on a rollout mesh that
splits their rows the same number of ways (their pieces are per device; another split is
refused, naming both). The prompt iterator's
state in the checkpoint is after those draws, so a resumed run draws batch n+k+1 next and
trains n+1..n+k on the very rollouts the interrupted run would have: its metrics equal the
uninterrupted run's, timings aside (tested after SIGKILL).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl.config import ConfigError
from jaxrl.rollout.inflight import split_ways
from jaxrl.saved.checkpoint import Checkpoints
from jaxrl.step.asynchronous import Produced, QueuedRollouts

DrawNotes = dict[int, tuple[np.ndarray, dict[str, float]]]  # step -> (positions_B, data metrics)


def _entry(tree: Any) -> dict[str, Any]:
    return {f"leaf_{j}": x for j, x in enumerate(jax.tree.leaves(tree))}


def queue_checkpoint(step: QueuedRollouts, drawn: DrawNotes
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arrays, JSON) of `step`'s pending batches for `Checkpoints.save(queue=...)`; `drawn`
    holds the loop's notes of each pending step's draw."""
    pending = step.pending()
    missing = [p.step for p in pending if p.step not in drawn]
    if missing:
        raise ValueError(f"the queue holds steps {missing} whose draws were not noted")
    arrays = {f"step_{p.step}": _entry(p.saved()) for p in pending}
    meta = {"pending": [
        {"step": p.step, "version": p.version, "made": p.made,
         "positions": np.asarray(drawn[p.step][0]).tolist(),
         "data_metrics": {k: float(v) for k, v in drawn[p.step][1].items()},
         **({} if p.made else {"split_ways": split_ways(p.partial[0])})}
        for p in pending]}
    return arrays, meta


def queue_entries(checkpoints: Checkpoints, at: int) -> list[dict[str, Any]]:
    """The JSON entries of checkpoint `at`'s pending batches, oldest first (none for a
    synchronous run's checkpoint)."""
    return checkpoints.restore_queue(at, None)[1].get("pending", [])


def restore_queue(checkpoints: Checkpoints, at: int, entries: list[dict[str, Any]],
                  abstract: dict[str, Any]) -> tuple[list[Produced], DrawNotes]:
    """(pending batches, their draws) of checkpoint `at` whose `queue_entries` are
    `entries`, the arrays in the layout of `abstract` (`QueuedRollouts.abstract_entries`: what
    `Produced.saved` holds of a made batch, and of one in flight)."""
    if not entries:
        return [], {}

    def kind(e):  # checkpoints from before in-flight updates hold made batches only
        return "made" if e.get("made", True) else "partial"

    missing = {kind(e) for e in entries} - set(abstract)
    if missing:
        raise ValueError(f"checkpoint {at} holds batches in flight (generated with "
                         f"rollout.inflight_updates=true); resume it with that setting")
    if "partial" in abstract:
        ways = split_ways(abstract["partial"][0])
        # Checkpoints from before the pieces were split hold one piece.
        saved = {int(e.get("split_ways", 1)) for e in entries if kind(e) == "partial"}
        if saved - {ways}:
            raise ConfigError(
                f"checkpoint {at} holds batches in flight split {saved.pop()} way(s) over the "
                f"rollout devices (the rollout layout's batch axes), this run's rollout "
                f"splits them {ways} way(s); resume it on the devices and layout it ran on "
                f"(a checkpoint of an older jaxrl holds them in one piece)")
    target = {f"step_{e['step']}": _entry(abstract[kind(e)]) for e in entries}
    arrays, _ = checkpoints.restore_queue(at, target)
    pending = []
    for e in entries:
        saved = arrays[f"step_{e['step']}"]
        leaves, treedef = jax.tree.flatten(abstract[kind(e)])
        tree = jax.tree.unflatten(treedef, [saved[f"leaf_{j}"] for j in range(len(leaves))])
        if kind(e) == "made":
            rollout, inputs, version_BxC = tree
            pending.append(Produced(int(e["step"]), int(e["version"]), rollout, inputs,
                                    version_BxC))
        else:
            pending.append(Produced(int(e["step"]), int(e["version"]), None, None,
                                    partial=tree))
    drawn = {int(e["step"]): (np.asarray(e["positions"], np.int64), dict(e["data_metrics"]))
             for e in entries}
    return pending, drawn
