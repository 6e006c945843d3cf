"""Records the golden metrics: `python tests/golden/record.py [name ...]` (all runs without a
name) runs each run of `runs.RUNS` and writes tests/golden/<name>.json, which
tests/run/test_golden_metrics.py compares every later run with.

Re-record only for an intended change of the numbers (a fix of the arithmetic, a new default),
never to make a failing comparison pass, and say in the commit which numbers changed and why.
A refactor (issue 41) must leave every golden as it is.

`--keys K1,K2 --why "..." [name ...]` re-records only those metric keys, for a change meant to
move exactly them (a metric's definition fixed): the run must still give every other metric
of the golden (the test's comparison), else nothing is written; the golden's "rerecorded"
list keeps which keys moved and why.

Runs in the tests' environment (tests/conftest.py: 8 fake CPU devices, its XLA flags and
compilation cache), from the repository root: `PYTHONPATH=$PWD python tests/golden/record.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.conftest  # noqa: E402, F401  (the tests' environment, before jax starts)
from tests.golden.runs import (  # noqa: E402
    EXCLUDED,
    RUNS,
    cpu,
    differences,
    golden_path,
    load_golden,
    train,
)


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
                          "cpu": cpu()},
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


def rerecord(name: str, keys: list[str], why: str) -> Path:
    """The golden of `name` with only `keys` taken from a new run (module docstring)."""
    golden = load_golden(name)
    with tempfile.TemporaryDirectory() as tmp:
        records = train(name, Path(tmp) / "run")

    def without(steps):
        return [{k: v for k, v in step.items() if k not in keys} for step in steps]

    problems = differences(name, without(golden["steps"]), without(records))
    if problems:
        sys.exit(f"{name}: metrics besides {keys} differ; nothing written:\n"
                 + "\n".join(problems[:50]))
    for old, new in zip(golden["steps"], records, strict=True):
        old.update({k: new[k] for k in keys if k in new})
    golden.setdefault("rerecorded", []).append({"keys": keys, "why": why})
    path = golden_path(name)
    path.write_text(dumps(golden), encoding="utf-8")
    return path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"runs (default all): {', '.join(RUNS)}")
    parser.add_argument("--keys", help="re-record only these comma-separated metric keys")
    parser.add_argument("--why", help="with --keys: the change that moved them")
    args = parser.parse_args(argv)
    if args.keys and not args.why:
        parser.error("--keys needs --why (kept in the golden beside the keys)")
    for name in args.names or list(RUNS):
        if name not in RUNS:
            parser.error(f"unknown run {name!r}: one of {', '.join(RUNS)}")
        path = (rerecord(name, args.keys.split(","), args.why) if args.keys
                else record(name))
        print(f"{name}: {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
