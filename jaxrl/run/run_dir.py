"""The run directory: what it holds, and a new one for a new run or the same one to resume.

    <run_dir>/config.yaml     the resolved config           metrics.jsonl  one line per step
              checkpoints/    orbax, one folder per step    tensorboard/   the same scalars
              init_model/     the random initial policy     final_model/   the trained policy
              eval.jsonl      one line per evaluation       reward.png     reward per step
              bench.json      `jaxrl bench`'s result        profile/       its --profile trace

Every module and command takes these names from here.

    prepare_run_dir(cfg, name) -> (run_dir, created, resume)

- `train.run_dir` unset: a new `runs/<name>-<date>-<time>` (a suffix when two runs start in
  the same second).
- `train.run_dir` set and holding complete checkpoints: the run resumes from them. Its saved
  config.yaml must agree with the new config except for RESUMABLE_KEYS (how long to train, how
  often to save or evaluate, logging and perf settings): resuming with another learning rate
  or dataset is a new experiment, so it is refused with the keys that differ.
- `train.run_dir` set and holding metrics but no checkpoint: refused (nothing to resume from,
  and a run directory is never overwritten). An empty or missing directory starts a new run.

Several processes: process 0 decides and writes, the others take its decision; then every
process must see the directory (each writes its own checkpoint shards into it), or the run
stops with an error naming the processes that cannot: `train.run_dir` must be on a
filesystem all hosts share, at the same path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from omegaconf import OmegaConf

from jaxrl.config import ExperimentConfig, RunDirError, to_yaml
from jaxrl.config.load import drop_removed
from jaxrl.distributed import broadcast, is_main, sync

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
INIT_MODEL_DIR = "init_model"
FINAL_MODEL_DIR = "final_model"
EVAL_FILE = "eval.jsonl"
PLOT_FILE = "reward.png"
BENCH_FILE = "bench.json"
PROFILE_DIR = "profile"
# Keys a resumed run may change (prefixes end with a dot).
RESUMABLE_KEYS = ("train.run_dir", "train.max_steps", "train.checkpoint_every",
                  "train.keep_checkpoints", "train.max_skipped_in_a_row", "train.save_final",
                  "train.target_reward", "eval.", "log.", "perf.", "distributed.")


def has_checkpoints(run_dir: Path) -> bool:
    """Whether `run_dir` holds at least one complete checkpoint."""
    directory = run_dir / CHECKPOINT_DIR
    # Finalized checkpoints only (orbax renames a checkpoint's directory when it is whole).
    return directory.is_dir() and bool(ocp.utils.checkpoint_steps(directory.absolute()))


def prepare_run_dir(cfg: ExperimentConfig, name: str) -> tuple[Path, bool, bool]:
    """(the run directory, whether this call created it, whether the run resumes); on
    several processes process 0 decides (module docstring)."""
    if jax.process_count() == 1:
        return _prepare(cfg, name)
    decision: dict = {}
    if is_main():
        try:
            run_dir, created, resume = _prepare(cfg, name)
            decision = {"run_dir": str(run_dir), "created": created, "resume": resume}
        except RunDirError as e:
            decision = {"error": str(e)}
    decision = broadcast(decision)
    if "error" in decision:
        raise RunDirError(decision["error"])
    run_dir = Path(decision["run_dir"])
    sync("jaxrl: run dir prepared")
    seen_P = multihost_utils.process_allgather(np.int32((run_dir / CONFIG_FILE).is_file()))
    blind = [int(p) for p in np.flatnonzero(np.asarray(seen_P) == 0)]
    if blind:
        raise RunDirError(
            f"train.run_dir {str(run_dir)!r} (written by process 0) is not visible to "
            f"process(es) {blind}: every process writes its checkpoint shards there, so it must "
            f"be on a filesystem all hosts share, at the same path (NFS, Lustre, a GCS bucket "
            f"mounted with gcsfuse)")
    return run_dir, decision["created"] and is_main(), decision["resume"]


def _prepare(cfg: ExperimentConfig, name: str) -> tuple[Path, bool, bool]:
    if cfg.train.run_dir:
        run_dir = Path(cfg.train.run_dir)
        if has_checkpoints(run_dir):
            _check_same_experiment(cfg, run_dir)
            (run_dir / CONFIG_FILE).write_text(to_yaml(cfg), encoding="utf-8")
            return run_dir, False, True
        if (run_dir / METRICS_FILE).exists():
            raise RunDirError(f"train.run_dir {str(run_dir)!r} already holds a run "
                              f"({METRICS_FILE}) but no checkpoint to resume from; choose a new "
                              f"train.run_dir")
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
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg), encoding="utf-8")
    return run_dir, created, False


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def _check_same_experiment(cfg: ExperimentConfig, run_dir: Path) -> None:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunDirError(f"train.run_dir {str(run_dir)!r} has checkpoints but no {CONFIG_FILE}: "
                          f"it was not written by jaxrl train")
    saved = _flatten(OmegaConf.to_container(drop_removed(OmegaConf.load(path))))
    new = _flatten(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))
    changed = [k for k in sorted(set(saved) | set(new))
               if saved.get(k) != new.get(k) and not any(
                   k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE_KEYS)]
    if changed:
        diff = "; ".join(f"{k}: {saved.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise RunDirError(f"train.run_dir {str(run_dir)!r} holds checkpoints of another "
                          f"experiment ({diff}); resume with the same config (only "
                          f"{', '.join(RESUMABLE_KEYS)} may change) or choose a new "
                          f"train.run_dir")
