"""The run directory of a new run, or the same one to resume (what it holds and its names:
`jaxrl.saved.files`).

    prepare_run_dir(cfg, name) -> Claim(run_dir, resume, made, note)

A folder is a run directory when it holds the marker `.jaxrl-run` (or, written by an earlier
jaxrl, a config.yaml beside metrics or checkpoints). A new run claims its folder by creating
the marker exclusively before anything else, so two runs never share one; the marker names
the host and process, and a start refuses a folder whose marker names a live jaxrl process.

- `train.run_dir` unset: a new `runs/<name>-<date>-<time>` (a suffix when two runs start in
  the same second).
- `train.run_dir` missing or an empty folder: a new run there.
- `train.run_dir` a folder with anything else in it that is not a run directory: refused.
  jaxrl never writes into a folder it did not make, and never changes what a user put there.
- A run directory holding complete checkpoints: the run resumes from them. Its saved
  config.yaml must agree with the new config except for RESUMABLE_KEYS (how long to train, how
  often to save or evaluate, logging and perf settings): resuming with another learning rate
  or dataset is a new experiment, so it is refused with the keys that differ.
- A run directory holding metrics but no checkpoint: refused (nothing to resume from, and a
  run directory is never overwritten).
- A run directory holding neither (a start killed before its first step, by SIGKILL or a
  crash of the process itself): cleared and started afresh, with a note. A start that fails
  with an error undoes its claim itself (`Claim.release`).

Several processes: process 0 decides and writes, the others take its decision; then every
process must see the directory (each writes its own checkpoint shards into it), or the run
stops with an error naming the processes that cannot: `train.run_dir` must be on a
filesystem all hosts share, at the same path.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from omegaconf import OmegaConf

from jaxrl import __version__
from jaxrl.config import ExperimentConfig, RunDirError, to_yaml
from jaxrl.config.load import upgrade_saved
from jaxrl.config_base import read_yaml
from jaxrl.distributed import broadcast, is_main, sync
from jaxrl.saved.files import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    INIT_MODEL_DIR,
    MARKER_FILE,
    METRICS_FILE,
    TENSORBOARD_DIR,
    has_checkpoints,
    is_run_dir,
)

# What a start writes before its first step: all a half-made run directory may hold.
_START_FILES = (MARKER_FILE, CONFIG_FILE, INIT_MODEL_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR)
# Keys a resumed run may change (prefixes end with a dot).
RESUMABLE_KEYS = ("train.run_dir", "train.max_steps", "train.checkpoint_every",
                  "train.keep_checkpoints", "train.max_skipped_in_a_row",
                  "train.reward_error_frac", "train.reward_error_steps", "train.save_final",
                  "train.target_reward", "eval.", "log.", "perf.", "distributed.")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A run directory claimed for this run (`prepare_run_dir`)."""

    run_dir: Path
    resume: bool  # it holds checkpoints of this experiment
    made: Path | None  # the outermost folder this call created (run_dir or a parent)
    note: str | None = None  # what the claim did that the user should know (a cleanup)

    def release(self) -> None:
        """Undoes a new run's claim after a failed start: the run dir goes if this call made
        it (and each parent it had to make, e.g. runs/, that is empty then), else its contents
        do (it was empty, or a half-made run directory)."""
        if self.resume or not is_main():
            return
        if self.made is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            # Parents only while empty: another run may have started in the same runs/.
            parent = self.run_dir
            while parent != self.made:
                parent = parent.parent
                try:
                    parent.rmdir()
                except OSError:
                    break
        else:
            _empty(self.run_dir)


def prepare_run_dir(cfg: ExperimentConfig, name: str) -> Claim:
    """The claimed run directory (module docstring); on several processes process 0 decides."""
    if jax.process_count() == 1:
        return _claim(cfg, name)
    decision: dict = {}
    if is_main():
        try:
            claim = _claim(cfg, name)
            decision = {"run_dir": str(claim.run_dir), "resume": claim.resume,
                        "made": claim.made and str(claim.made), "note": claim.note}
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
    # Only process 0 may undo the claim (the others see its folder).
    made = Path(decision["made"]) if decision["made"] and is_main() else None
    return Claim(run_dir, decision["resume"], made, decision["note"])


def claim_to_add(run_dir: Path) -> None:
    """Readies `run_dir` for a command that adds to it (`jaxrl eval`: init_model/,
    eval.jsonl): a run directory as it is, a missing or empty folder claimed with the marker,
    anything else refused like `prepare_run_dir` refuses it. On several processes process 0
    claims it and the others wait (each claiming raced for the marker: the loser was told
    another run had claimed the folder)."""
    if jax.process_count() == 1:
        return _claim_to_add(run_dir)
    error = {}
    if is_main():
        try:
            _claim_to_add(run_dir)
        except RunDirError as e:
            error = {"error": str(e)}
    error = broadcast(error)
    if "error" in error:
        raise RunDirError(error["error"])
    sync("jaxrl: run dir ready to add to")


def _claim_to_add(run_dir: Path) -> None:
    where = f"train.run_dir {str(run_dir)!r}"
    try:
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirError(f"{where} is a file; expected a folder")
        if is_run_dir(run_dir):
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _refuse_foreign(run_dir, where)
        _write_marker(run_dir)
    except PermissionError as e:
        raise RunDirError(f"{where} cannot be written: permission denied on "
                          f"{e.filename!r}") from None


def _claim(cfg: ExperimentConfig, name: str) -> Claim:
    try:
        if not cfg.train.run_dir:
            return _claim_new(name)
        run_dir = Path(cfg.train.run_dir)
        claim = _claim_given(cfg, run_dir)
        (run_dir / CONFIG_FILE).write_text(to_yaml(cfg), encoding="utf-8")
        return claim
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # a fault (disk full), not a bad train.run_dir
        why = "permission denied" if isinstance(e, PermissionError) else e.strerror or str(e)
        raise RunDirError(f"train.run_dir {str(cfg.train.run_dir or 'runs/')!r} cannot be "
                          f"written: {why} on {e.filename!r}; choose a folder you can write "
                          f"(or fix its permissions)") from None


def _claim_new(name: str) -> Claim:
    """A new `runs/<name>-<date>-<time>[-k]`: mkdir is atomic, so two runs never share one."""
    stem = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for suffix in ("", *(f"-{i}" for i in range(1, 1000))):
        run_dir = Path(stem + suffix)
        try:
            made = _make(run_dir)
        except FileExistsError:
            continue
        _write_marker(run_dir)
        return Claim(run_dir, resume=False, made=made)
    raise RunDirError(f"1,000 run directories named {stem}-* already exist; set train.run_dir")


def _claim_given(cfg: ExperimentConfig, run_dir: Path) -> Claim:
    """`train.run_dir` set: resume it, start it afresh, or refuse (module docstring)."""
    where = f"train.run_dir {str(run_dir)!r}"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{where} is a file; expected a folder (new, empty, or a jaxrl run "
                          f"directory to resume)")
    if not run_dir.exists():
        made = _make(run_dir)
        _write_marker(run_dir)
        return Claim(run_dir, resume=False, made=made)
    if not is_run_dir(run_dir):
        _refuse_foreign(run_dir, where)
        _write_marker(run_dir)
        return Claim(run_dir, resume=False, made=None)
    _refuse_if_live(run_dir, where)
    if has_checkpoints(run_dir):
        _check_same_experiment(cfg, run_dir)
        _write_marker(run_dir, exclusive=False)  # now this process's (or an earlier jaxrl's dir)
        return Claim(run_dir, resume=True, made=None)
    if (run_dir / METRICS_FILE).exists():
        raise RunDirError(f"{where} already holds a run ({METRICS_FILE}) but no checkpoint to "
                          f"resume from; choose a new train.run_dir")
    # A marker and neither metrics nor checkpoints: a start that was killed before its first
    # step (a crash of the process itself: a failed start removes what it made), unless
    # something else lives there (`jaxrl eval`'s results).
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in _START_FILES)
    if others:
        raise RunDirError(f"{where} holds {', '.join(others)} but no training run to resume "
                          f"(no checkpoint, no {METRICS_FILE}); choose a new train.run_dir")
    _empty(run_dir)
    _write_marker(run_dir)
    return Claim(run_dir, resume=False, made=None,
                 note=f"{run_dir} held a start that was interrupted before its first step "
                      f"(no metrics, no checkpoint): it was cleared and starts afresh")


def _make(run_dir: Path) -> Path:
    """Creates `run_dir` and its missing parents (FileExistsError when `run_dir` exists);
    returns the outermost folder created."""
    outermost = run_dir
    while not outermost.parent.exists() and outermost.parent != outermost:
        outermost = outermost.parent
    run_dir.mkdir(parents=True)
    return outermost


def _refuse_foreign(run_dir: Path, where: str) -> None:
    """Refuses `run_dir` (not a run directory) unless it is empty."""
    entries = sorted(p.name for p in run_dir.iterdir())
    if entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more"
                                          if len(entries) > 5 else "")
        raise RunDirError(f"{where} is a folder with other files in it ({shown}) and not a "
                          f"jaxrl run directory (no {MARKER_FILE}); jaxrl never writes into a "
                          f"folder it did not make: choose a new or empty folder")


def _write_marker(run_dir: Path, *, exclusive: bool = True) -> None:
    """Claims `run_dir` with its marker, created exclusively (of two runs starting in the same
    folder at once, one fails here), or rewritten for this process when resuming."""
    record = {"jaxrl_version": __version__, "host": socket.gethostname(), "pid": os.getpid(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        with open(run_dir / MARKER_FILE, "x" if exclusive else "w", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except FileExistsError:
        raise RunDirError(f"train.run_dir {str(run_dir)!r} was claimed by another run starting "
                          f"at the same time; choose another train.run_dir") from None


def _refuse_if_live(run_dir: Path, where: str) -> None:
    """Refuses a run directory whose marker names a live process on this host (a run in
    progress: two runs writing one folder would mix their checkpoints and metrics)."""
    try:
        record = json.loads((run_dir / MARKER_FILE).read_text(encoding="utf-8"))
        pid, host = int(record["pid"]), record["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no marker (an earlier jaxrl) or an unreadable one: nothing to check
    if host != socket.gethostname() or pid == os.getpid():
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    except PermissionError:
        pass  # alive, another user's
    if _is_jaxrl(pid):
        raise RunDirError(f"{where} is in use by a running jaxrl process (pid {pid} on this "
                          f"host); wait for it to end or stop it (Ctrl-C saves a checkpoint)")


def _is_jaxrl(pid: int) -> bool:
    """Whether process `pid` runs jaxrl (a reused pid of another program does not count);
    True where that cannot be told (no /proc)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return True
    return b"jaxrl" in cmdline


def _empty(run_dir: Path) -> None:
    """Removes everything inside `run_dir`, keeping the folder."""
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


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
    saved = _flatten(OmegaConf.to_container(upgrade_saved(read_yaml(path, what="the run's saved"))))
    new = _flatten(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))
    # A key the saved config lacks was added by a later jaxrl: the run had its default.
    defaults = _flatten(OmegaConf.to_container(OmegaConf.structured(ExperimentConfig)))
    saved = {k: saved.get(k, defaults.get(k)) for k in set(saved) | set(defaults)}
    changed = [k for k in sorted(set(saved) | set(new))
               if saved.get(k) != new.get(k) and not any(
                   k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE_KEYS)]
    if changed:
        diff = "; ".join(f"{k}: {saved.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise RunDirError(f"train.run_dir {str(run_dir)!r} holds checkpoints of another "
                          f"experiment ({diff}); resume with the same config (only "
                          f"{', '.join(RESUMABLE_KEYS)} may change) or choose a new "
                          f"train.run_dir")
