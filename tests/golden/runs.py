"""The golden runs: small deterministic `jaxrl train` runs whose every metric is recorded in
tests/golden/<name>.json (`record.py`) and compared by tests/run/test_golden_metrics.py, so
that a refactor of the step, the loop or the config (issue 41) can be shown to change no
number.

Each run goes through the entry point a user types, `jaxrl train CONFIG overrides`: the
quickstart prefix as a real `jaxrl` process on one CPU device (as README runs it), the others
through `jaxrl.cli.main` in process on the tests' 8 fake CPU devices (tests/conftest.py).

The comparison (`differences`) is meant to hold on any x86-64 CPU, not only the one that
recorded the goldens: XLA:CPU's fp32 kernels round differently on another CPU (vector width,
FMA), so it allows ten times the drift measured between two CPUs (`REL`, `ABS`), over the
steps where their trajectories stayed comparable (`HORIZON`), and checks the rest of each run
on what no CPU's roundoff moves (`WHOLE_RUN`, the keys, finite values).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent
QUICKSTART = "configs/quickstart.yaml"
TOOL = "configs/tool_multiplication.yaml"

# Metrics left out of the goldens: they measure wall-clock time (or are divided by it), so
# they differ between two runs of the same steps. Every other key of metrics.jsonl is kept,
# deterministic counts included (perf/model_flops, perf/xla_flops, token counts, bytes).
EXCLUDED = {
    "time/": "wall-clock seconds of the step and its phases",
    "perf/tokens_per_s": "tokens over the step's wall-clock seconds",
    "perf/mfu": "model FLOPs over the step's wall-clock seconds",
    "perf/hfu": "hardware FLOPs over the step's wall-clock seconds",
    "tool/latency_s": "wall-clock seconds of the tool calls",
    "env/time_s": "wall-clock seconds spent in the environment",
    "env/wait_s": "wall-clock seconds the rollout waited for the environment",
}


def excluded(key: str) -> bool:
    return any(key.startswith(prefix) if prefix.endswith("/") else key == prefix
               for prefix in EXCLUDED)


# Off in every run: they write files or evaluate, and none of them writes metrics.jsonl.
QUIET = ["eval.num_prompts=0", "log.plot=false", "log.tensorboard=false",
         "train.save_final=false", "train.checkpoint_every=0", "log.print_every=1"]
# The quickstart shrunk to a few seconds a step on the 8-device test mesh (tests/run/test_loop).
SMALL = ["data.batch_size=8", "data.num_prompts=64", "rollout.num_generations=4",
         "algo.num_minibatches=2", "algo.num_iterations=1"]

# name: (config, overrides, process). process: a real `jaxrl` process on one CPU device;
# otherwise `jaxrl.cli.main` in process (8 devices).
RUNS: dict[str, tuple[str, list[str], bool]] = {
    # The shipped quickstart's first 64 steps, nothing else changed: its learning-rate warm-up
    # (800 updates, 50 steps of 16) and the start of the cosine decay (optim.total_steps is
    # fixed: the schedule does not depend on train.max_steps).
    "quickstart": (QUICKSTART, ["train.max_steps=64", *QUIET], True),
    "async": (QUICKSTART, [*SMALL, *QUIET, "train.max_steps=4", "algo.mode=async",
                           "sharding.rollout_devices=4", "algo.max_staleness=2",
                           "algo.loss.tis_cap=2.0"], False),
    "multiturn": (TOOL, ["data.batch_size=4", "rollout.num_generations=4",
                         "algo.num_minibatches=2", *QUIET, "train.max_steps=3",
                         "sharding.layout=dp_fsdp_tp"], False),
    "lora": (QUICKSTART, [*SMALL, *QUIET, "train.max_steps=3", "sharding.layout=fsdp",
                          "model.lora.rank=4", "model.lora.alpha=8",
                          "model.lora.target_modules=[.*_proj]", "optim.lr=0.05",
                          "optim.warmup_steps=0", "algo.loss.beta=0.05"], False),
    "moe": (QUICKSTART, [*SMALL, *QUIET, "train.max_steps=3", "sharding.layout=fsdp_ep",
                         "model.init.family=qwen3_moe", "model.init.num_experts=4",
                         "model.init.num_experts_per_tok=2",
                         "model.init.moe_intermediate_size=32", "algo.router_aux_coef=0.01",
                         "optim.warmup_steps=0"], False),
    "gae": (QUICKSTART, [*SMALL, *QUIET, "train.max_steps=4", "sharding.layout=fsdp",
                         "algo.advantage=gae", "algo.critic.kind=separate",
                         "algo.critic.warmup_steps=1", "algo.mask_zero_std_groups=false",
                         "optim.warmup_steps=0"], False),
}


def train(name: str, run_dir: Path) -> list[dict]:
    """Runs `name` into run_dir (`jaxrl train CONFIG run_dir overrides`): its metrics.jsonl
    records, the value of each excluded key replaced by None (the key is kept: a metric that
    appears or disappears is a change too)."""
    config, overrides, process = RUNS[name]
    argv = ["train", str(ROOT / config), f"train.run_dir={run_dir}", *overrides]
    if process:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
        result = subprocess.run([str(Path(sys.executable).parent / "jaxrl"), *argv], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=3600)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        from jaxrl.cli import main

        assert main(argv) == 0, f"jaxrl {' '.join(argv)} failed"
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [{k: None if excluded(k) else v for k, v in r.items()} for r in records]


# The vector features XLA:CPU generates its kernels for: fp32 sums of another width round
# differently, which the comparison allows for (REL, HORIZON) but a failure should name.
_VECTOR_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw", "avx512vl",
                 "avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu() -> str:
    """This machine's CPU as a golden's recorded_with.cpu names it: model name, family and
    model, and its vector features (`_VECTOR_FLAGS`), e.g. 'AMD EPYC (family 23, model 1;
    sse4_2 avx f16c fma avx2)'."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\n", 1)[0]  # the first logical CPU's fields
    except OSError:
        return platform.processor()
    fields = dict((k.strip(), v.strip()) for k, _, v in
                  (line.partition(":") for line in first.splitlines()))
    flags = set(fields.get("flags", "").split())
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}; {' '.join(f for f in _VECTOR_FLAGS if f in flags)})")


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def load_golden(name: str) -> dict:
    return json.loads(golden_path(name).read_text(encoding="utf-8"))


# The drift measured between two CPUs (jax 0.10.2; `record.py --drift`): the goldens' AMD
# EPYC (family 23, model 1; AVX2) and an Intel Xeon (family 6, model 167; AVX-512). While the
# trajectories agreed, every run's sampled tokens, rewards, lengths, counts and FLOP counts
# were bit-identical; the other metrics differed by fp32 roundoff: relative differences of at
# most 5.0e-7 (the quickstart's first 16 steps; 7.5e-7 in its first 31), 4.6e-7 (MoE),
# 1.5e-7 (multi-turn), 1.7e-6 (async) and 6.2e-6 (LoRA's first 2 steps). Values small by
# cancellation (differences of O(1) terms: GAE's loss/policy 4e-3 and value/
# explained_variance -1e-2, async's kl_behaviour 1e-15..3e-7) differed by at most 1.2e-7
# absolute (one ulp of 1.0), up to 1.2e-5 (GAE) and 6e-2 (kl_behaviour 1e-15) relative.
# REL and ABS are an order of magnitude above them (math.isclose: either one suffices).
# Changes they catch and one they do not: tests/run/test_golden_metrics.py's docstring.
REL = 1e-4
ABS = 1e-6

# The steps compared at REL/ABS, where the two CPUs' trajectories stayed comparable (all the
# run's steps when not here). The quickstart: roundoff (<= 7.5e-7) through step 30, then
# grad_norm's difference grows (5.9e-6 at step 31, 2e-4 at 34), a token crosses the clip
# range at 35 (clip_frac), a sampled token flips at 36 (completion/len_mean) and the rewards
# differ from 38: after that the runs are two samples of the same training. Its horizon is
# half the 31 steps measured, a margin for a CPU that parts sooner. LoRA (optim.lr=0.05, no
# warm-up): 6.2e-6 at step 1, then its large updates amplify the roundoff and step 2's
# grad_norm differs by 7.7e-4, its samples still the same. Later steps are compared on
# WHOLE_RUN and the invariants of `differences`.
HORIZON = {"quickstart": 16, "lora": 2}

# Metrics that neither the sampled tokens nor the weights move in these runs, compared at
# REL/ABS at every step, past the horizon too (measured: bit-identical on both CPUs at every
# step, after the quickstart's trajectories parted as well).
WHOLE_RUN = {
    "step": "the step's index",
    "lr": "the schedule: a function of the update count",
    "data/epoch": "prompts drawn over prompts",
    # The decode loop runs the whole token budget while some completion takes it: every
    # step of these runs (completion/len_mean >= 3.28 of max_new_tokens 4 in the quickstart).
    "rollout/num_steps": "filled completion columns: the token budget",
    "rollout/decode_slot_steps": "one-row forward passes of the decode loop",
    "perf/model_flops": "counted from the programs' shapes and rollout/decode_slot_steps",
    "perf/xla_flops": "counted from the programs' shapes and rollout/decode_slot_steps",
    "perf/analytic_flops": "counted from the programs' shapes and rollout/decode_slot_steps",
    "train/skipped_steps": "0: no step of these runs is skipped as non-finite",
    "train/skipped_updates": "0: no update of these runs is skipped as non-finite",
    "train/skipped_in_a_row": "0: no update of these runs is skipped as non-finite",
}


def differences(name: str, want: list[dict], got: list[dict]) -> list[str]:
    """Every difference of the steps `got` from the golden `want`: at every step, the same
    keys (a metric that appears or disappears), a number where the golden has one, finite
    where the golden's is finite and not where it is not, and the WHOLE_RUN metrics within
    REL/ABS; in the run's HORIZON, every metric within REL/ABS (math.isclose: the relative or
    the absolute difference). The excluded keys' values (wall-clock time) are not compared."""
    problems = []
    if len(got) != len(want):
        problems.append(f"{name}: {len(got)} steps, golden {len(want)}")
    horizon = HORIZON.get(name, len(want))
    for i, (w, g) in enumerate(zip(want, got, strict=False)):  # lengths: above
        step = w.get("step", i)
        for key in sorted(w.keys() - g.keys()):
            problems.append(f"{name} step {step}: {key} disappeared (golden {w[key]})")
        for key in sorted(g.keys() - w.keys()):
            problems.append(f"{name} step {step}: {key} appeared (got {g[key]})")
        for key in sorted(w.keys() & g.keys()):
            if excluded(key) or w[key] == g[key]:
                continue
            if not (_number(w[key]) and _number(g[key])) or _finite(w[key]) != _finite(g[key]):
                problems.append(f"{name} step {step}: {key} golden {w[key]!r} got {g[key]!r}")
            elif ((i < horizon or key in WHOLE_RUN) and _finite(w[key])
                  and not math.isclose(g[key], w[key], rel_tol=REL, abs_tol=ABS)):
                problems.append(f"{name} step {step}: {key} golden {w[key]!r} got {g[key]!r}"
                                f" (rel {relative(w[key], g[key]):.1e})")
    return problems


def _number(value) -> bool:
    return isinstance(value, (int, float))


def _finite(value) -> bool:
    return _number(value) and math.isfinite(value)


def relative(a: float, b: float) -> float:
    """|a - b| over the larger of |a| and |b| (as math.isclose measures it); 0 if equal."""
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))
