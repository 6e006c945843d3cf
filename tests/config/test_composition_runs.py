"""Every cell of the composition matrix (docs/composition.md) as `jaxrl` processes (process
tier): each one-process cell that runs trains 3 steps as its own `jaxrl train` on 8 fake CPU
devices, and each two-process cell that runs trains 3 steps through
`launch/local_multiprocess.sh 2` (gloo; 2 processes x 2 devices, or x 4 for the async cells,
whose rollout takes 4 devices of its own). Every process compiles with LLVM's cheap settings
(tests/launch_env.py: these cells check that a combination trains, not its numbers). Of the 40 refused
two-process cells, one per distinct refusal (4) is launched the same way and must exit with
status 2 and its message; every refused cell's message is computed by loading its config and
planning it for 2 processes (`composition.refusal`, the same `plan` the run calls; checked
in the fast tier, tests/config/test_composition.py); a run plans before it loads the
weights, but a launch still costs seconds (jax.distributed, the random policy).

A cell that trains must leave 3 metric records (steps 0, 1, 2) whose policy loss and gradient
norm are finite. Each run is its own process: 32 trainings in one pytest worker once aborted
it (XLA's CPU collectives deadlocked, see jaxrl/runtime.py), and a process that dies fails
only its own cell. The refused one-process cells are checked in the fast tier
(tests/config/test_composition.py).
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config.composition import Cell, cells, config_name, overrides, refusal
from jaxrl.run.metrics_log import read_metrics
from tests.launch_env import FAST_COMPILE, SMALL

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
JAXRL = str(Path(sys.executable).parent / "jaxrl")
QUIET = ["eval.num_prompts=0", "log.plot=false", "log.tensorboard=false",
         "train.save_final=false", "train.checkpoint_every=0", "perf.count_flops=false",
         "train.max_steps=3"]
RUNS_ONE_PROCESS = [c for c in cells() if c.processes == 1 and refusal(c) is None]

def _two_process_cells() -> list[Cell]:
    """The two-process cells that run, and the first cell of each distinct refusal."""
    picked, refusals = [], set()
    for cell in cells():
        why = refusal(cell) if cell.processes == 2 else None
        if cell.processes == 2 and (why is None or why not in refusals):
            picked.append(cell)
            refusals.add(why)
    return picked


TWO_PROCESSES = _two_process_cells()
TIMEOUT_S = 600


def _argv(cell: Cell, run_dir: Path) -> list[str]:
    return [str(ROOT / "configs" / config_name(cell)), f"train.run_dir={run_dir}",
            *overrides(cell), *QUIET]


def _env(**extra: str) -> dict[str, str]:
    # this tree's jaxrl, whatever is installed; XLA_FLAGS as tests/conftest.py set them, and cheap
    return dict(os.environ, PYTHONPATH=str(ROOT),
                XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {FAST_COMPILE}", **extra)


def _check(cell: Cell, result: subprocess.CompletedProcess, run_dir: Path) -> None:
    """The cell was refused with its message (exit 2), or trained 3 finite steps."""
    why = refusal(cell)
    if why is not None:
        assert result.returncode == 2, (cell.name, result.stderr[-3000:])
        assert " ".join(why.split()) in " ".join(result.stderr.split()), cell.name
        assert not (run_dir / "metrics.jsonl").exists()
        # refused when planned: before the weights load and the prompts are tokenized
        assert " parameters (" not in result.stderr and "data: task" not in result.stderr, (
            cell.name, result.stderr[-3000:])
        return
    assert result.returncode == 0, (cell.name, result.stdout[-1000:], result.stderr[-3000:])
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2], cell.name
    for r in records:
        for key in ("loss/policy", "grad_norm"):
            assert math.isfinite(r[key]), (cell.name, r["step"], key, r[key])


@pytest.mark.parametrize("cell", RUNS_ONE_PROCESS, ids=lambda c: c.name)
def test_a_one_process_cell_trains_three_steps(cell, tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([JAXRL, "train", *_argv(cell, run_dir)], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    _check(cell, result, run_dir)


@pytest.mark.parametrize("cell", TWO_PROCESSES, ids=lambda c: c.name)
def test_a_two_process_cell_trains_three_steps_or_is_refused(cell, tmp_path):
    run_dir = tmp_path / "run"
    devices = {} if cell.mode.startswith("async") else SMALL
    result = subprocess.run(
        [str(ROOT / "launch" / "local_multiprocess.sh"), "2", *_argv(cell, run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
        env=_env(JAXRL_BIN=JAXRL, JAXRL_LOG_DIR=str(tmp_path / "logs"), JAXRL_GRACE_S="30",
                 **devices))
    _check(cell, result, run_dir)
