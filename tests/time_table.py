"""Where the suite's time goes: `python tests/time_table.py TIMES.jsonl [...]` prints Markdown
tables of the tests' seconds by tier, by test file and by what the tests guard, from the JSON
lines that tests/conftest.py appends to $JAXRL_TEST_TIMES (one per test: its node id, its
setup + call + teardown seconds, the XLA compile seconds of its pytest process in setup and
call, its tier). `.ci/run` writes them and prints the tables at its end; docs/testing.md
keeps the measured ones. Compile seconds count only what the pytest process compiled: a test
that starts `jaxrl` has its processes' compiling in its run seconds.

`--before-durations OLD.log` (a pytest `--durations=0` report of an earlier run) adds its
seconds as a "before" column."""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

# What a test guards, by the first prefix of its node id that matches (else its folder).
GUARDS = (
    ("tests/run/test_golden_metrics.py::test_metrics_equal", "goldens: every metric of small runs"),
    ("tests/config/test_composition", "combinations: the composition cells"),
    ("tests/test_docs.py::test_runnable_block", "docs: every runnable block"),
    ("tests/launch/", "launchers: TPU pod, SLURM (a real cluster), local processes"),
    ("tests/distributed/", "several processes: jax.distributed, per-host rows, caches"),
    ("tests/run/test_resume.py", "failure classes: stops, kills and resume"),
    ("tests/run/test_env_failures.py", "failure classes: environments"),
    ("tests/commands/test_failures.py", "failure classes: seen from outside"),
    ("tests/commands/test_train.py::test_quickstart_learns", "learning: thresholds"),
    ("tests/commands/test_train.py::test_a_reward", "failure classes: rewards"),
    ("tests/commands/", "commands: train, eval, generate, check, export, bench"),
    ("tests/test_shipped_configs.py", "shipped configs load and train"),
    ("tests/run/", "the run: loop, hooks, async, multi-turn, run directory"),
    ("tests/step/", "the step: every mode and feature in process"),
    ("tests/rollout/", "the rollout engine: slots, pages, sampling, parity"),
    ("tests/models/", "models: parity with transformers, LoRA, MoE, kernels"),
    ("tests/rl/", "RL math: log-probs, advantages, GAE, losses, rewards"),
    ("tests/sharding/", "sharding: layouts, rules, creation"),
    ("tests/perf/", "perf: FLOPs, MFU, memory fit, profiles"),
    ("tests/config/", "config: loading, errors, plan"),
    ("tests/data/", "data: tasks, sources, prompts, curriculum"),
    ("tests/envs/", "environments and tools (the sandbox)"),
    ("tests/saved/", "checkpoints and saved policies"),
    ("tests/serve/", "serving (JetStream)"),
    ("tests/", "the rest: CLI, imports, tiers, docs pages, runtime"),
)


def guard(test: str) -> str:
    return next(label for prefix, label in GUARDS if test.startswith(prefix))


def read_times(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


_DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")


def read_durations(path: Path) -> dict[str, float]:
    """Seconds per node id from a pytest `--durations=0` report (setup + call + teardown)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text(errors="replace").splitlines():
        match = _DURATION.match(line)
        if match:
            seconds[match.group(3)] += float(match.group(1))
    return dict(seconds)


def _table(title: str, key, rows: list[dict], before: dict[str, float] | None) -> list[str]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        groups[key(row["test"], row)].append(row)
    old: dict[str, float] = collections.defaultdict(float)
    for test, seconds in (before or {}).items():
        old[key(test, {"test": test, "tier": "?"})] += seconds
    head = f"| {title} | tests | s | compile s |" + (" s before |" if before else "")
    lines = [head, "|---|---:|---:|---:|" + ("---:|" if before else "")]
    order = sorted(set(groups) | set(old), key=lambda g: -sum(r["s"] for r in groups.get(g, [])))
    for name in order:
        group = groups.get(name, [])
        cells = [name, str(len(group)), f"{sum(r['s'] for r in group):.0f}",
                 f"{sum(r['compile_s'] for r in group):.0f}"]
        if before:
            cells.append(f"{old[name]:.0f}" if name in old else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tables(rows: list[dict], before: dict[str, float] | None = None, top: int = 30) -> str:
    """The Markdown tables: by tier, by what the tests guard, by file (the `top` slowest)."""
    by_file = _table("file", lambda test, _: test.split("::")[0], rows, before)
    return "\n".join([
        *_table("tier", lambda _, row: row["tier"], rows, None), "",
        *_table("what the tests guard", lambda test, _: guard(test), rows, before), "",
        *by_file[:top + 2]]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("times", nargs="+", type=Path)
    parser.add_argument("--before-durations", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    before = read_durations(args.before_durations) if args.before_durations else None
    print(tables(read_times(args.times), before, args.top), end="")


if __name__ == "__main__":
    main()
