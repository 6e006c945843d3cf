"""The composition matrix (docs/composition.md) trained for real, one run per distinct program
(process tier). Cells that compile the same program share a run (`programs`):

- a one-process cell and its two-process twin: on the same 4 devices in all (one process of 4
  fake CPU devices, or `launch/local_multiprocess.sh 2` with 2 each) the program is the same
  SPMD program over the same mesh, so the two-process run stands for both (what only one
  process does, its host code, is what every in-process test of the fast tier runs);
- a multi-turn cell asking for algo.mode=fused and its split twin: the run's plan switches
  fused to split (`jaxrl.config.plan`), so both compile the split programs.

Of the two-process refusals, one is launched (exit status 2, its message, before the weights
load): the failure class "refused when planned, in a second process"; every cell's refusal
message is computed by planning it and checked in the fast tier
(tests/config/test_composition.py), as is this grouping (`programs` covers every cell that
runs, once). Every process compiles with the tests' cheap settings (tests/launch_env.py TEST_COMPILE:
these runs check that a combination trains, not its numbers).

A run must leave 3 metric records (steps 0, 1, 2) whose policy loss and gradient norm are
finite. Each run is its own process: 32 trainings in one pytest worker once aborted it (XLA's
CPU collectives deadlocked, see jaxrl/runtime.py), and a process that dies fails only its own
run.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config import composition
from jaxrl.config.composition import Cell, cells, config_name, overrides, refusal
from jaxrl.run.metrics_log import read_metrics
from tests.launch_env import SMALL, TEST_COMPILE

ROOT = Path(__file__).resolve().parents[2]
JAXRL = str(Path(sys.executable).parent / "jaxrl")
QUIET = ["eval.num_prompts=0", "log.plot=false", "log.tensorboard=false",
         "train.save_final=false", "train.checkpoint_every=0", "perf.count_flops=false",
         "train.max_steps=3"]
DEVICES = int(SMALL["JAXRL_CPU_DEVICES"])  # in all, however many processes
TIMEOUT_S = 600


def program(cell: Cell) -> tuple | None:
    """What a cell compiles: its planned mode (not the mode asked for), whether the rollout
    takes in-flight weight updates, and the features; the process count is not in it (module
    docstring). None for a refused cell."""
    planned = composition.planned(cell)
    if isinstance(planned, str):
        return None
    return (planned.mode, planned.inflight, cell.turns, cell.advantage, cell.params, cell.arch)


@functools.cache
def programs() -> dict[tuple, list[Cell]]:
    """Every distinct program of the cells that run -> those cells, the two-process one first
    where there is one (that is the one run)."""
    groups: dict[tuple, list[Cell]] = {}
    for cell in cells():
        key = program(cell)
        if key is not None:
            groups.setdefault(key, []).append(cell)
    return {key: sorted(group, key=lambda c: -c.processes) for key, group in groups.items()}


def first_refusals() -> list[Cell]:
    """The first refused two-process cell (the failure class launched end to end)."""
    return [next(c for c in cells() if c.processes == 2 and refusal(c) is not None)]


RUNS = [group[0] for group in programs().values()]


def _argv(cell: Cell, run_dir: Path) -> list[str]:
    return [str(ROOT / "configs" / config_name(cell)), f"train.run_dir={run_dir}",
            *overrides(cell), *QUIET]


def _launch(cell: Cell, run_dir: Path, logs: Path) -> subprocess.CompletedProcess:
    """The cell on DEVICES fake CPU devices in all: `jaxrl train` in one process, or the local
    launcher over two; this tree's jaxrl, XLA's flags as tests/conftest.py set them but the
    device count, and the tests' cheap settings."""
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=f"{flags} {TEST_COMPILE}")
    if cell.processes == 1:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={DEVICES}"
        argv = [JAXRL, "train", *_argv(cell, run_dir)]
    else:
        env.update(JAXRL_BIN=JAXRL, JAXRL_LOG_DIR=str(logs), JAXRL_GRACE_S="30", **SMALL)
        argv = [str(ROOT / "launch" / "local_multiprocess.sh"), "2", *_argv(cell, run_dir)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _name(cell: Cell) -> str:
    others = [c.name for c in programs()[program(cell)] if c != cell]
    return cell.name + (f" (also {', '.join(others)})" if others else "")


@pytest.mark.process
@pytest.mark.parametrize("cell", RUNS, ids=_name)
def test_each_distinct_program_of_the_matrix_trains_three_steps(cell, tmp_path):
    run_dir = tmp_path / "run"
    result = _launch(cell, run_dir, tmp_path / "logs")
    assert result.returncode == 0, (cell.name, result.stdout[-1000:], result.stderr[-3000:])
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2], cell.name
    for r in records:
        for key in ("loss/policy", "grad_norm"):
            assert math.isfinite(r[key]), (cell.name, r["step"], key, r[key])


@pytest.mark.process
@pytest.mark.parametrize("cell", first_refusals(), ids=lambda c: c.name)
def test_a_refused_two_process_cell_exits_2_with_its_message_before_the_weights_load(
        cell, tmp_path):
    run_dir = tmp_path / "run"
    result = _launch(cell, run_dir, tmp_path / "logs")
    assert result.returncode == 2, (cell.name, result.stderr[-3000:])
    assert " ".join(refusal(cell).split()) in " ".join(result.stderr.split()), cell.name
    assert not (run_dir / "metrics.jsonl").exists()
    # refused when planned: before the weights load and the prompts are tokenized
    assert " parameters (" not in result.stderr and "data: task" not in result.stderr, (
        cell.name, result.stderr[-3000:])
