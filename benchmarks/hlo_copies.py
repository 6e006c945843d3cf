"""Layout copies and transposes per decoder layer in the compiled RL step's optimized HLO.

    python benchmarks/hlo_copies.py [CONFIG] [overrides ...] [--layers 2 4] [--json]

Builds the step of CONFIG (default: configs/quickstart.yaml with the vs-TRL policy's shapes:
hidden 256, 4 heads / 2 KV heads, intermediate 768, vocabulary 4096, 8 prompts x 8 samples x 64
tokens) twice, with `model.init.num_layers` = each of `--layers`, compiles its programs and
counts their instructions by the groups of `jaxrl.perf.profile` (copies: copy, transpose and
data-movement fusions, or fusions holding a transpose or copy). Per layer is the difference
between the two depths divided by the difference in layers, so what every step does once
(embedding, sampler, optimizer) cancels. A count is static: an instruction inside the decode
loop's body counts once, as it appears in the program. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console

from jaxrl.config import ExperimentConfig, load_config
from jaxrl.perf.profile import op_groups, parse_hlo
from jaxrl.run.start import start_run

ROOT = Path(__file__).resolve().parents[1]
VS_TRL_SHAPES = [
    "model.init.hidden_size=256", "model.init.intermediate_size=768", "model.init.num_heads=4",
    "model.init.num_kv_heads=2", "model.init.vocab_size=4096", "data.batch_size=8",
    "rollout.num_generations=8", "rollout.max_new_tokens=64", "rollout.ignore_eos=true",
    "algo.num_minibatches=1", "algo.num_iterations=1", "sharding.layout=single",
    "algo.mode=split",
]


def count_groups(config: str, overrides: list[str]) -> dict[str, dict[str, int]]:
    """{program: {group: instructions}} of the compiled step of `config` + `overrides`."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ExperimentConfig, config, [*overrides, f"train.run_dir={tmp}/run",
                                   "perf.count_flops=false"])
        started = start_run(cfg, "hlo", Console(file=sys.stderr, quiet=True), resumable=False)
        out = {}
        for name, compiled in started.run.step.compiled().items():
            out[name] = executed_counts(compiled.as_text())
    return out


def executed_counts(text: str) -> dict[str, int]:
    """{group: executed instructions} of an HLO module, plus "layout": copies and transposes
    (a copy or transpose instruction, or a fusion without a dot that holds one; in any group).

    Executed: the entry computation's instructions and, transitively, those of the while
    bodies/conditions, conditional branches and calls in it; a fusion counts once, not the
    instructions of its fused computation."""
    computations = parse_hlo(text)
    groups = op_groups([text])
    entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.MULTILINE).group(1)
    counts: Counter[str] = Counter()
    todo, seen = [entry], set()
    while todo:
        comp = todo.pop()
        if comp in seen:
            continue
        seen.add(comp)
        for name, inst in computations.get(comp, {}).items():
            if inst.opcode in ("while", "conditional", "call"):
                todo.extend(inst.calls)
                continue
            group = groups.get(name)
            if group is None or inst.opcode in _FREE:
                continue
            counts[group] += 1
            inner = _fused_opcodes(computations, inst)
            if group != "matmul" and ({inst.opcode} | inner) & {"copy", "transpose"}:
                counts["layout"] += 1
    return dict(counts)


# Instructions that move no data (tuple plumbing, views, constants).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def _fused_opcodes(computations, inst) -> set[str]:
    out: set[str] = set()
    todo = list(inst.calls) if inst.opcode == "fusion" else []
    while todo:
        for inner in computations.get(todo.pop(), {}).values():
            out.add(inner.opcode)
            todo.extend(inner.calls)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--layers", type=int, nargs=2, default=(2, 4))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    overrides = args.overrides if args.overrides or args.config != parser.get_default(
        "config") else VS_TRL_SHAPES
    lo, hi = args.layers
    counts = {n: count_groups(args.config, [*overrides, f"model.init.num_layers={n}"])
              for n in (lo, hi)}
    result = {}
    for program in counts[hi]:
        a, b = counts[lo].get(program, {}), counts[hi][program]
        result[program] = {
            group: {"total": b.get(group, 0),
                    "per_layer": (b.get(group, 0) - a.get(group, 0)) / (hi - lo)}
            for group in sorted(set(a) | set(b))}
    if args.json:
        print(json.dumps(result))
        return
    for program, groups in result.items():
        print(f"{program}:")
        for group, c in groups.items():
            print(f"  {group:12s} per layer {c['per_layer']:6.1f}   total ({hi} layers) "
                  f"{c['total']}")


if __name__ == "__main__":
    main()
