"""A mixture-of-experts GRPO step on 8 CPU devices, with and without expert parallelism.

    python benchmarks/moe.py [--steps 12] [--rounds 2] [--experts 16] [--top-k 2] [--json]
    python benchmarks/moe.py --dispatch [--tokens 2048] [--experts 16] [--top-k 2]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe.py --collectives

Runs `jaxrl train configs/quickstart.yaml` with a random qwen3_moe policy (model.init:
hidden 128, 4 layers, `--experts` experts of width 128, `--top-k` per token; 16 prompts x 8
samples x 8 new tokens, 2 updates per step, router_aux_coef 0.001) on the 8 host devices, once with the `fsdp` preset (every expert split along embed over fsdp, as dense
weights are) and once with `fsdp_ep` (the experts split by expert over fsdp: each device
holds whole experts), interleaved for `--rounds` rounds so that the machine's drift hits
both alike. Per run, the median over the steps after the first two (compiles) of
time/step_s, time/generate_s and time/train_s (perf.phase_times=true), and the parameters'
bytes per device. The 8 devices share this machine's cores: the comparison is of what XLA
makes of each layout (collectives, copies), not of accelerator bandwidth.

`--dispatch` times the experts alone on one device instead (forward + backward of
`jaxrl.models.moe.dispatch` on `--tokens` tokens, hidden 128, width 128): jax.lax.ragged_dot,
tokamax.ragged_dot when tokamax is installed, and the gathered-weight dispatch; median of 20
calls after a warm-up. `--collectives` compiles the step of each layout (same policy and
shapes, 8 devices; nothing runs) and counts the collectives in its optimized HLO by kind,
with the bytes of their results (static: an instruction inside a loop body counts once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxrl.run.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RUN = ["perf.phase_times=true", "perf.count_flops=false", "eval.num_prompts=0",
       "log.plot=false", "log.tensorboard=false", "train.checkpoint_every=0",
       "train.save_final=false", "log.print_every=1000", "data.curriculum=none",
       "model.init.family=qwen3_moe", "model.init.hidden_size=128", "model.init.num_layers=4",
       "model.init.moe_intermediate_size=128", "model.init.tie_word_embeddings=false",
       "algo.router_aux_coef=0.001", "rollout.max_new_tokens=8", "data.batch_size=16",
       "algo.num_minibatches=2", "algo.num_iterations=1"]
NAMES = ("step_s", "generate_s", "train_s")
SKIP = 2  # the first steps compile
LAYOUTS = ("fsdp", "fsdp_ep")


def run(layout: str, steps: int, run_dir: Path, experts: int, top_k: int) -> dict:
    """One training run's medians of NAMES."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    command = [sys.executable, "-m", "jaxrl.cli", "train", "configs/quickstart.yaml",
               f"train.max_steps={steps}", f"train.run_dir={run_dir}", *RUN,
               f"sharding.layout={layout}", f"model.init.num_experts={experts}",
               f"model.init.num_experts_per_tok={top_k}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{layout} failed:\n{done.stderr[-3000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")[SKIP:]
    out: dict = {"layout": layout}
    for key in NAMES:
        out[key] = float(np.median([r[f"time/{key}"] for r in records]))
    out["router_aux"] = float(np.mean([r["loss/router_aux"] for r in records]))
    return out


def dispatch_times(tokens: int, experts: int, top_k: int, e: int = 128, f: int = 128) -> None:
    """Forward + backward time of each expert dispatch on one device (module docstring)."""
    import time

    import jax
    import jax.numpy as jnp

    from jaxrl.models import moe

    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, e))
    _, experts_NxK = jax.lax.top_k(jax.random.normal(keys[1], (tokens, experts)), top_k)
    weights = jnp.full((tokens, top_k), 1.0 / top_k)
    gate_up = 0.05 * jax.random.normal(keys[2], (experts, e, 2, f))
    down = 0.05 * jax.random.normal(keys[3], (experts, f, e))
    impls = {"jax.lax.ragged_dot": moe.dispatch, "gather": moe.gather_dispatch}
    try:
        import tokamax
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags, which would parse our argv

        def tokamax_dispatch(*args):
            return moe.dispatch(*args, ragged_dot=tokamax.ragged_dot)

        impls["tokamax.ragged_dot"] = tokamax_dispatch
    except ImportError:
        pass
    for name, impl in impls.items():
        def loss(x, gate_up, down, impl=impl):
            return jnp.sum(impl(x, weights, experts_NxK, gate_up, down) ** 2)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(step(x, gate_up, down))
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(step(x, gate_up, down))
            times.append(time.perf_counter() - start)
        flops = step.lower(x, gate_up, down).compile().cost_analysis()["flops"]
        print(f"{name:<20} {np.median(times) * 1e3:8.2f} ms   XLA flops {flops:.3g}   "
              f"routed-expert flops {3 * 2 * tokens * top_k * 3 * e * f:.3g}")


_COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-to-all|reduce-scatter|all-reduce|"
                         r"collective-permute)(?:-start)?\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def collectives(experts: int, top_k: int) -> None:
    """Collectives by kind in each layout's compiled step programs (module docstring)."""
    from rich.console import Console

    from jaxrl.config import ExperimentConfig, load_config
    from jaxrl.run.start import start_run

    for layout in LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ExperimentConfig, ROOT / "configs" / "quickstart.yaml", [
                *RUN, f"sharding.layout={layout}", f"model.init.num_experts={experts}",
                f"model.init.num_experts_per_tok={top_k}", f"train.run_dir={tmp}/run"])
            started = start_run(cfg, "moe", Console(file=sys.stderr, quiet=True),
                                resumable=False)
            for program, compiled in started.run.step.compiled().items():
                counts: dict[str, list[int]] = {}
                for shape, kind in _COLLECTIVE.findall(compiled.as_text()):
                    size = sum(_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",")
                                                                if d] or [1]))
                               for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))
                    n, total = counts.get(kind, [0, 0])
                    counts[kind] = [n + 1, total + size]
                cells = ", ".join(f"{k} {n} ({b / 2**20:.1f} MiB)"
                                  for k, (n, b) in sorted(counts.items()))
                print(f"{layout:<8} {program:<10} {cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dispatch", action="store_true")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--collectives", action="store_true")
    args = parser.parse_args(argv)
    if args.collectives:
        collectives(args.experts, args.top_k)
        return
    if args.dispatch:
        dispatch_times(args.tokens, args.experts, args.top_k)
        return
    if args.steps <= SKIP:
        parser.error(f"--steps must be more than {SKIP}")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            rounds.append([run(layout, args.steps, Path(tmp) / f"{i}-{layout}", args.experts,
                               args.top_k) for layout in LAYOUTS])
    results = []
    for j, layout in enumerate(LAYOUTS):
        per_round = [r[j] for r in rounds]
        merged = {"layout": layout, "rounds": args.rounds,
                  "step_s_range": [min(r["step_s"] for r in per_round),
                                   max(r["step_s"] for r in per_round)]}
        for key in (*NAMES, "router_aux"):
            merged[key] = float(np.median([r[key] for r in per_round]))
        results.append(merged)
    if args.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"{'layout':<10}" + "".join(f"{n:>14}" for n in NAMES) + f"{'router_aux':>12}"
          + "  step_s range")
    for r in results:
        low, high = r["step_s_range"]
        print(f"{r['layout']:<10}" + "".join(f"{r[n] * 1e3:>11.1f} ms" for n in NAMES)
              + f"{r['router_aux']:>12.3f}  {low * 1e3:.0f}-{high * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
