"""Grouping a trace's XLA op events (`jaxrl.perf.profile`) on a hand-written program."""

import gzip
import json

import pytest

from jaxrl.perf.profile import GROUPS, op_groups, parse_hlo, summarize_trace

HLO = """HloModule jit_step, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%fused_dot (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_move (p0: f32[8,8], i: s32[]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %t = f32[8,8]{0,1} transpose(%p0), dimensions={1,0}
  ROOT %c = f32[8,8]{1,0} copy(%t)
}

%fused_transpose_silu (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %t = f32[8,8]{0,1} transpose(%p0), dimensions={1,0}
  ROOT %m = f32[8,8]{1,0} multiply(%t, %t)
}

%fused_softmax (p0: f32[8,8]) -> f32[8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %e = f32[8,8]{1,0} exponential(%p0)
  %z = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%e, %z), dimensions={1}, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main.9 (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %mm = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/mlp/dot_general"}
  %scores = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/layer/attention/dot_general"}
  %dscores = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/transpose(jvp(attention))/dot_general"}
  %notattn = f32[8,8]{1,0} fusion(%x, %x), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/self_attention_out/dot_general"}
  %i0 = s32[] constant(0)
  %mv = f32[8,8]{1,0} fusion(%mm, %i0), kind=kLoop, calls=%fused_move
  %sm = f32[8]{0} fusion(%mv), kind=kLoop, calls=%fused_softmax
  %ts = f32[8,8]{1,0} fusion(%mv), kind=kLoop, calls=%fused_transpose_silu
  %ar = f32[8,8]{1,0} all-reduce(%mv), replica_groups={}, to_apply=%add
  %cb = f32[8]{0} custom-call(%sm), custom_call_target="xla_python_cpu_callback"
  %ew = f32[8,8]{1,0} multiply(%ar, %ar)
  ROOT %w = f32[8,8]{1,0} while(%ew), condition=%add, body=%add
}
"""


def test_each_instruction_falls_in_its_group():
    groups = op_groups([HLO])
    assert groups["mm"] == "matmul"
    assert groups["scores"] == "attention"  # the named scope wins over the dot inside
    assert groups["dscores"] == "attention"  # and its gradient
    assert groups["notattn"] == "matmul"  # a scope only named like it is not it
    assert groups["mv"] == "copies"  # a transpose and a copy (scalar index arithmetic aside)
    assert groups["ts"] == "copies"  # a layout change with arithmetic fused in
    assert groups["sm"] == "reductions"
    assert groups["ar"] == "collectives" and groups["cb"] == "host"
    assert groups["ew"] == "other"
    assert groups["w"] is None  # a container: its body's ops have their own events
    assert parse_hlo(HLO)["fused_move"]["j"].scalar


def test_trace_events_are_summed_per_step(tmp_path):
    events = [{"ph": "X", "name": "mm", "dur": 300.0}, {"ph": "X", "name": "mm", "dur": 100.0},
              {"ph": "X", "name": "scores", "dur": 50.0}, {"ph": "X", "name": "w", "dur": 9e6},
              {"ph": "X", "name": "PjitFunction(step)", "dur": 7e6},  # host Python: left out
              {"ph": "i", "name": "mm"}]  # not a duration event
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    split = summarize_trace(tmp_path, op_groups([HLO]), steps=2)
    assert tuple(split.group_s) == GROUPS
    assert split.group_s["matmul"] == pytest.approx(200e-6)
    assert split.group_s["attention"] == pytest.approx(25e-6)
    assert split.total_s == pytest.approx(225e-6)
    assert split.top[0] == ("mm", "matmul", pytest.approx(200e-6), 1.0)
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        summarize_trace(tmp_path / "none", {}, steps=1)
