"""What a run directory holds, by name, and how to tell one:

    <run_dir>/.jaxrl-run      the claim (written first)     config.yaml    the resolved config
              metrics.jsonl   one line per step
              checkpoints/    orbax, one folder per step    tensorboard/   the same scalars
              checkpoints_damaged/  unreadable checkpoints, moved out of checkpoints/
              init_model/     the random initial policy     final_model/   the trained policy
              eval.jsonl      one line per evaluation       reward.png     reward per step
              bench.json      `jaxrl bench`'s result        profile/       its --profile trace

Every module and command takes these names from here.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

MARKER_FILE = ".jaxrl-run"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
DAMAGED_CHECKPOINT_DIR = "checkpoints_damaged"  # outside orbax's directory: not a step
TENSORBOARD_DIR = "tensorboard"
INIT_MODEL_DIR = "init_model"
FINAL_MODEL_DIR = "final_model"
EVAL_FILE = "eval.jsonl"
PLOT_FILE = "reward.png"
BENCH_FILE = "bench.json"
PROFILE_DIR = "profile"


def has_checkpoints(run_dir: Path) -> bool:
    """Whether `run_dir` holds at least one complete checkpoint."""
    directory = run_dir / CHECKPOINT_DIR
    # Finalized checkpoints only (orbax renames a checkpoint's directory when it is whole).
    return directory.is_dir() and bool(ocp.utils.checkpoint_steps(directory.absolute()))


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a jaxrl run directory: its marker, or (written before there was a
    marker) a config.yaml beside metrics or checkpoints."""
    return (path / MARKER_FILE).is_file() or ((path / CONFIG_FILE).is_file() and (
        (path / METRICS_FILE).is_file() or (path / CHECKPOINT_DIR).is_dir()))
