"""Where a profiled step's time goes: the XLA op events of a `jax.profiler` trace, grouped.

    groups = op_groups(hlo_texts)                 instruction name -> group, from the programs
    split = summarize_trace(trace_dir, groups)    after `jax.profiler.stop_trace()`

A trace started with `create_perfetto_trace=True` holds one event per executed XLA op (named
as its HLO instruction: `fusion.12`, `ynn_fusion.3`, `all-reduce.1`, ...). Each instruction
of the compiled program(s) falls in one group:

    attention    anything under the model's `jax.named_scope("attention")` (scores, softmax,
                 weighted values, and their gradients; the XLA path and kernels alike)
    matmul       a dot or convolution, or a fusion whose computation contains one
    collectives  all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    host         host callbacks (the Python rewards), infeed / outfeed, send / recv
    copies       copy, transpose, gather / scatter, slices and concatenations, and fusions
                 made of nothing else (data moved, no arithmetic) or holding a transpose or
                 copy (a layout change: its strided reads cost more than the elementwise
                 arithmetic fused with it)
    reductions   a reduce (or reduce-window), or a fusion containing one
    other        the rest: elementwise fusions, sorts, random bits
    (while, conditional and call are containers: their bodies' ops have their own events,
    so the containers themselves are not counted)

The split is per measured step: each group's total event time / steps. Events whose name is
no instruction of the programs (Python, the runtime) are left out, so the groups add up to the
device time of the ops, not to the step's wall time.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections import Counter
from pathlib import Path

GROUPS = ("matmul", "attention", "copies", "reductions", "collectives", "host", "other")
_CONTAINERS = {"while", "conditional", "call"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_HOST = {"infeed", "outfeed", "send", "send-done", "recv", "recv-done"}
_MOVES = {"copy", "transpose", "gather", "scatter", "slice", "dynamic-slice",
          "dynamic-update-slice", "concatenate", "pad", "reverse", "bitcast", "reshape",
          "broadcast", "copy-start", "copy-done", "get-tuple-element", "tuple", "parameter",
          "constant", "iota", "bitcast-convert", "convert"}
# `%name = type opcode(operands), attributes`: opcode is the word before the first "(" after
# the type (types may hold parentheses: tuples).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\(")
_SCALAR = re.compile(r"[a-z]+[0-9]*\[\]")
# The scope as a path component, also under autodiff: attention/, jvp(attention)/,
# transpose(jvp(attention))/.
_ATTENTION = re.compile(r"(?:^|[/(])attention(?:[)/]|$)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    opcode: str
    scalar: bool  # its result is one number (index arithmetic: not what a fusion is for)
    op_name: str  # the metadata's op_name (named scopes, jitted functions)
    calls: tuple[str, ...]  # computations it calls (a fusion's body)
    custom_target: str


def parse_hlo(text: str) -> dict[str, dict[str, Instruction]]:
    """{computation: {instruction: Instruction}} of an HLO module's text (`compiled.as_text()`)."""
    computations: dict[str, dict[str, Instruction]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and "=" not in stripped.split("(")[0]:
            name = stripped.split()[1] if stripped.startswith("ENTRY") else stripped.split()[0]
            current = computations.setdefault(name.lstrip("%"), {})
            continue
        if current is None or (m := _INSTRUCTION.match(line)) is None:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        calls = tuple(c.strip().lstrip("%") for one, many in _CALLS.findall(line)
                      for c in (one or many).split(",") if c.strip())
        current[m.group(1)] = Instruction(m.group(3), bool(_SCALAR.fullmatch(m.group(2))),
                                          op_name.group(1) if op_name else "", calls,
                                          target.group(1) if target else "")
    return computations


def op_groups(hlo_texts: list[str]) -> dict[str, str | None]:
    """Instruction name -> group (module docstring; None: a container) over the programs."""
    out: dict[str, str | None] = {}
    for text in hlo_texts:
        computations = parse_hlo(text)
        memo: dict[str, frozenset[str]] = {}
        for comp in computations.values():
            for name, inst in comp.items():
                inside = set().union(*(_opcodes(computations, c, memo) for c in inst.calls))
                out.setdefault(name, _group(inst, inside))
    return out


def _opcodes(computations: dict[str, dict[str, Instruction]], name: str,
             memo: dict[str, frozenset[str]]) -> frozenset[str]:
    """The opcodes of array results in computation `name` and what it calls, transitively
    (HLO's call graph has no cycles; each computation is walked once)."""
    if name not in memo:
        found = set()
        for inst in computations.get(name, {}).values():
            if not inst.scalar:
                found.add(inst.opcode)
            for callee in inst.calls:
                found |= _opcodes(computations, callee, memo)
        memo[name] = frozenset(found)
    return memo[name]


def _group(inst: Instruction, inside: set[str]) -> str | None:
    op = inst.opcode
    if op in _CONTAINERS:
        return None
    if any(op.startswith(c) for c in _COLLECTIVES):
        return "collectives"
    if op in _HOST or (op == "custom-call" and "callback" in inst.custom_target.lower()):
        return "host"
    if _ATTENTION.search(inst.op_name):
        return "attention"
    ops = inside | {op} if op != "fusion" else inside
    if ops & {"dot", "convolution"}:
        return "matmul"
    if ops & {"reduce", "reduce-window"}:
        return "reductions"
    if ops and (ops <= _MOVES or ops & {"copy", "transpose"}):
        return "copies"
    return "other"


@dataclasses.dataclass(frozen=True)
class TraceSplit:
    """Device time per measured step by group, and the ops that took the most."""

    steps: int
    group_s: dict[str, float]  # seconds per step
    top: list[tuple[str, str, float, float]]  # (op, group, seconds per step, calls per step)

    @property
    def total_s(self) -> float:
        return sum(self.group_s.values())


def summarize_trace(trace_dir: Path, groups: dict[str, str | None], steps: int,
                    top: int = 10) -> TraceSplit:
    """The split of the newest Perfetto trace under `trace_dir` (module docstring)."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir} (was the trace started "
                                f"with create_perfetto_trace=True?)")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    time_us: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for event in events:
        name = event.get("name")
        if event.get("ph") == "X" and name in groups and groups[name] is not None:
            time_us[name] += float(event.get("dur", 0.0))
            calls[name] += 1
    group_s = dict.fromkeys(GROUPS, 0.0)
    for name, us in time_us.items():
        group_s[groups[name]] += us / 1e6 / steps
    ranked = [(name, groups[name], us / 1e6 / steps, calls[name] / steps)
              for name, us in time_us.most_common(top)]
    return TraceSplit(steps, group_s, ranked)
