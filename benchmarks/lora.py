"""LoRA against full fine-tuning on CPU, and the rollout's two ways of applying adapters.

    python benchmarks/lora.py                 # both parts, ~10 minutes on 2 busy cores
    python benchmarks/lora.py --part decode   # merged vs on-the-fly decode only

Part `step`: `jaxrl bench` of the quickstart workload (addition, 32 prompts x 8 samples, 4
new tokens, 16 optimizer updates per step) on a wider random policy (E = --hidden, 4 layers,
F = 4E: ~3.9M parameters at E = 256), once with full fine-tuning and once with
`model.lora.rank=8` on every projection, alternated --rounds times in one sitting (this
machine's 2 cores change speed between sittings). Reported per run: the median step time,
its generate/train split, and XLA's planned peak memory of the step program; then the LoRA /
full ratios of the medians over the rounds.

Part `decode`: the rollout of one RL step (`Sampler.generate`: prefill + decode loop) on the
same shape with rank-8 adapters (random, non-zero) on every projection, `rollout: merged`
(W' = W + s A B folded once per call, then plain decoding) against `on_the_fly` (x W + s (x A) B
at every token), alternated; median of --repeats calls after a warm-up call each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _shape(hidden: int) -> list[str]:
    return [f"model.init.hidden_size={hidden}", f"model.init.intermediate_size={4 * hidden}",
            "model.init.num_layers=4", "model.init.num_heads=4", "model.init.num_kv_heads=2"]


def bench_step(hidden: int, lora: bool, steps: int) -> dict:
    """One `jaxrl bench` run of the quickstart on the wider policy; its JSON line."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["model.lora.rank=8", "model.lora.alpha=16"] if lora else []
        cmd = [str(Path(sys.executable).parent / "jaxrl"), "bench",
               str(ROOT / "configs" / "quickstart.yaml"), f"train.run_dir={tmp}/run",
               "log.tensorboard=false", "log.plot=false", "eval.num_prompts=0",
               *_shape(hidden), *extra, "--steps", str(steps), "--warmup", "2"]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])


def part_step(args) -> None:
    runs = {"full": [], "lora": []}
    for _ in range(args.rounds):
        for name in ("full", "lora"):
            r = bench_step(args.hidden, name == "lora", args.steps)
            runs[name].append(r)
            print(f"{name:5s} step {r['step_s'] * 1e3:7.1f} ms  generate "
                  f"{(r.get('generate_s') or 0) * 1e3:6.1f} ms  train "
                  f"{(r.get('train_s') or 0) * 1e3:6.1f} ms  peak "
                  f"{r['peak_memory_bytes'] / 2**20:6.1f} MiB", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("step_s",
                                                                 "peak_memory_bytes")}
           for k, v in runs.items()}
    print(f"LoRA / full: step time {med['lora']['step_s'] / med['full']['step_s']:.2f}"
          f", peak memory {med['lora']['peak_memory_bytes'] / med['full']['peak_memory_bytes']:.2f}")


def part_decode(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl.models import ModelConfig, Transformer
    from jaxrl.models.lora_config import LORA_MODULES, LoraConfig
    from jaxrl.rollout import Prompts, Sampler, SamplerConfig

    h = args.hidden
    base = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=h,
                       intermediate_size=4 * h, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=h // 4, qkv_bias=True, tie_word_embeddings=True,
                       attention_impl="xla")
    rng = np.random.default_rng(0)
    prompts = Prompts(jnp.asarray(rng.integers(2, 512, (args.batch, 16)), jnp.int32),
                      jnp.ones((args.batch, 16), bool))
    samplers = {}
    for mode in ("merged", "on_the_fly"):
        config = dataclasses.replace(base, lora=LoraConfig(8, 16.0, LORA_MODULES, rollout=mode))
        graphdef, adapters, rest = nnx.split(Transformer(config, rngs=nnx.Rngs(0)),
                                             nnx.LoRAParam, ...)
        adapters = jax.tree.map(lambda x: 0.02 * jnp.asarray(rng.standard_normal(x.shape),
                                                             x.dtype), adapters)
        sampler = Sampler(graphdef, SamplerConfig(args.max_new_tokens, args.generations))
        params = nnx.merge_state(adapters, rest)
        jax.block_until_ready(sampler.generate(params, prompts, jax.random.key(0)))
        samplers[mode] = (sampler, params)
    times = {mode: [] for mode in samplers}
    for i in range(args.repeats):
        for mode, (sampler, params) in samplers.items():
            start = time.perf_counter()
            jax.block_until_ready(sampler.generate(params, prompts, jax.random.key(i)))
            times[mode].append(time.perf_counter() - start)
    rows = args.batch * args.generations
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f"{mode:10s} rollout {med * 1e3:7.1f} ms  ({rows * args.max_new_tokens / med:,.0f}"
              f" tokens/s; {rows} rows x {args.max_new_tokens} tokens)")
    print(f"on_the_fly / merged: {statistics.median(times['on_the_fly']) / statistics.median(times['merged']):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("step", "decode", "both"), default="both")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.part in ("decode", "both"):
        part_decode(args)
    if args.part in ("step", "both"):
        part_step(args)


if __name__ == "__main__":
    main()
