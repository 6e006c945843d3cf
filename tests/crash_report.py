"""What an xdist worker was doing when it died, in the failure's own report, and the one rerun
of a test whose worker XLA aborted.

xdist reports a worker killed by a signal as "worker 'gw1' crashed while running T" and
nothing more: Python's fault handler printed every thread's stack to the worker's stderr,
lost among the progress dots of a long CI log. Here each worker's fault handler writes to a
file of its own instead (`enable`), and the controller puts that file's tail in the crashed
test's report (`describe`), which the summary of failures prints. The files live in a folder
of the run's own (`folder`: made by the controller, inherited by its workers) and go with it
(`remove`).

A worker that XLA aborted (SIGABRT: "Fatal Python error: Aborted") runs its test once more on
a fresh worker (`rerun_once`); the rerun must pass, and the abort is reported (RERUN, with the
dump). Why: XLA:CPU's in-process collectives can deadlock, and abort after 40 s, when two
devices of one program run independent collectives in different orders (jaxrl/runtime.py);
it happens at random on the test machine's 8 fake devices (measured: the shipped recipes'
2-step trainings run 5 in a row in one process, with the `jaxrl` command's scheduler flag:
3 of 4 such processes aborted, in the PPO recipe). One device has no collectives; a GPU or
TPU runs each device's program in order on its own stream. A test that aborts twice fails.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

ENV = "JAXRL_TESTS_CRASH_DIR"
_open_files = []  # the fault handler writes to the file's descriptor: keep it open


def folder() -> Path:
    """This run's folder: made by the first process that asks (the controller, which starts
    its workers after), named to them by $JAXRL_TESTS_CRASH_DIR."""
    if not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="jaxrl-tests-crashes-")
    return Path(os.environ[ENV])


def enable(worker: str) -> Path:
    """This process's fault handler (a segfault, an abort, ...: every thread's Python stack)
    writes to its own file, named by `worker` and the process id."""
    path = folder() / f"{worker}-{os.getpid()}.txt"
    f = path.open("w", encoding="utf-8")
    _open_files.append(f)
    faulthandler.enable(file=f, all_threads=True)
    return path


def describe(worker: str, max_lines: int = 120) -> str:
    """The newest non-empty fault-handler file of `worker` (its last `max_lines` lines), or
    a line saying there is none."""
    dumps = sorted((p for p in folder().glob(f"{worker}-*.txt") if p.stat().st_size),
                   key=lambda p: p.stat().st_mtime)
    if not dumps:
        return f"(no fault-handler output from {worker} in {folder()})"
    lines = dumps[-1].read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join([f"{worker}'s fault handler ({dumps[-1]}):", *lines[-max_lines:]])


_rerun: set[str] = set()


def rerun_once(nodeid: str, dump: str) -> bool:
    """Whether the test `nodeid`, whose worker died leaving `dump`, runs once more: only after
    an abort, and only once."""
    if "Fatal Python error: Aborted" not in dump or nodeid in _rerun:
        return False
    _rerun.add(nodeid)
    return True


def remove() -> None:
    """The run's folder goes (at the controller's end, after every report was made)."""
    shutil.rmtree(folder(), ignore_errors=True)
