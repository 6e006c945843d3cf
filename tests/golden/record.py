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

`--drift [name ...]` writes nothing: it runs them and prints, step by step, the largest
relative difference from the golden and its key, how many metrics differ, and whether the
sampled completions still agree. This is how runs.py's REL, ABS and HORIZON were chosen,
from the drift between two CPUs; measure again on a CPU where only the goldens fail, or
after re-recording a golden (a new trajectory may part sooner).

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
    HORIZON,
    RUNS,
    cpu,
    differences,
    excluded,
    golden_path,
    load_golden,
    relative,
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


def drift(name: str) -> None:
    """Prints how a new run of `name` differs from its golden, step by step (module
    docstring)."""
    golden = load_golden(name)
    with tempfile.TemporaryDirectory() as tmp:
        records = train(name, Path(tmp) / "run")
    print(f"{name}: {len(records)} steps (golden {len(golden['steps'])}); recorded on "
          f"{golden['recorded_with']['cpu']}, this CPU {cpu()}; horizon "
          f"{HORIZON.get(name, len(golden['steps']))}", flush=True)
    for i, (want, got) in enumerate(zip(golden["steps"], records, strict=False)):
        numbers = [k for k in want.keys() & got.keys() if not excluded(k)
                   and all(isinstance(v, (int, float)) for v in (want[k], got[k]))]
        rel = {k: relative(want[k], got[k]) for k in numbers}
        key = max(rel, key=rel.get)
        sampled = all(want.get(k) == got.get(k) for k in ("completion/len_mean", "reward/mean"))
        print(f"  step {want.get('step', i)}: max rel {rel[key]:.1e} ({key}: golden "
              f"{want[key]!r} got {got[key]!r}); {sum(v > 0 for v in rel.values())} of "
              f"{len(rel)} differ; completions {'agree' if sampled else 'differ'}", flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"runs (default all): {', '.join(RUNS)}")
    parser.add_argument("--keys", help="re-record only these comma-separated metric keys")
    parser.add_argument("--why", help="with --keys: the change that moved them")
    parser.add_argument("--drift", action="store_true",
                        help="write nothing: print each step's difference from the golden")
    args = parser.parse_args(argv)
    if args.keys and not args.why:
        parser.error("--keys needs --why (kept in the golden beside the keys)")
    if args.drift and args.keys:
        parser.error("--drift writes nothing: no --keys")
    for name in args.names or list(RUNS):
        if name not in RUNS:
            parser.error(f"unknown run {name!r}: one of {', '.join(RUNS)}")
        if args.drift:
            drift(name)
            continue
        path = (rerecord(name, args.keys.split(","), args.why) if args.keys
                else record(name))
        print(f"{name}: {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
