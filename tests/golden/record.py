"""Records the golden metrics: `python tests/golden/record.py [name ...]` (all runs without a
name) runs each run of `runs.RUNS` and writes tests/golden/<name>.json, which
tests/run/test_golden_metrics.py compares every later run with.

Re-record only for an intended change of the numbers (a fix of the arithmetic, a new default),
never to make a failing comparison pass, and say in the commit which numbers changed and why.
A refactor (issue 41) must leave every golden as it is.

Runs in the tests' environment (tests/conftest.py: 8 fake CPU devices, its XLA flags and
compilation cache), from the repository root: `PYTHONPATH=$PWD python tests/golden/record.py`.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.conftest  # noqa: E402, F401  (the tests' environment, before jax starts)
from tests.golden.runs import EXCLUDED, RUNS, golden_path, train  # noqa: E402


def _cpu() -> str:
    """The CPU's model name (XLA's CPU kernels, hence fp32 roundoff, depend on it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def record(name: str) -> Path:
    import jax
    import jaxlib

    config, overrides, process = RUNS[name]
    with tempfile.TemporaryDirectory() as tmp:
        records = train(name, Path(tmp) / "run")
    golden = {
        "run": name,
        "command": ["jaxrl", "train", config, "train.run_dir=<tmp>", *overrides],
        "devices": "1 CPU device (a jaxrl process)" if process else
                   "8 CPU devices (tests/conftest.py, jaxrl.cli.main in process)",
        "recorded_with": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                          "python": platform.python_version(), "machine": platform.machine(),
                          "cpu": _cpu()},
        # Their values are null in "steps": the key was written, its value is not compared.
        "excluded": EXCLUDED,
        "steps": records,
    }
    path = golden_path(name)
    path.write_text(dumps(golden), encoding="utf-8")
    return path


def dumps(golden: dict) -> str:
    """JSON with one line per step (a diff then shows which steps changed); Python's float
    repr round-trips, so a value reads back bit for bit."""
    head = json.dumps({k: v for k, v in golden.items() if k != "steps"}, indent=1)
    steps = ",\n".join("  " + json.dumps(step) for step in golden["steps"])
    return f'{head[:-2]},\n "steps": [\n{steps}\n ]\n}}\n'


if __name__ == "__main__":
    for name in sys.argv[1:] or list(RUNS):
        if name not in RUNS:
            sys.exit(f"unknown run {name!r}: one of {', '.join(RUNS)}")
        print(f"{name}: {record(name)}", flush=True)
