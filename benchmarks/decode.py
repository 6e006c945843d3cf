"""Sampler speed: prefill tokens/s, decode tokens/s, and bytes moved per decode step.

    python benchmarks/decode.py                       # a ~30M-parameter Qwen2-shaped model
    python benchmarks/decode.py --hidden 1536 --layers 28 --heads 12 --kv-heads 2 \\
        --intermediate 8960 --vocab 151936 --dtype bfloat16 --batch 64   # Qwen2.5-1.5B shape

A decode step reads every weight once plus the KV cache, so its time is bounded below by
bytes / memory bandwidth, and by FLOPs / matmul rate (which binds first on a CPU). The sampler attends over the whole preallocated cache (masked),
so the cache term is the full cache, not the filled part. The script prints the bytes per
step, the achieved bytes/s, and (with --bandwidth-gbs or a measured host copy rate) how far
decoding is from that bound. Random weights; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import KVCache, ModelConfig, Transformer, default_positions
from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams
from jaxrl.runtime import configure_xla
from jaxrl.sharding import create_sharded, load_layout, make_mesh, use_rules


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2", choices=["llama", "mistral", "qwen2", "qwen3"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16, help="rows decoded together")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layout", default="fsdp", help="preset or YAML; weights use its rollout rules")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="device memory bandwidth in GB/s (default: measured host copy rate)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="device matmul rate in GFLOP/s (default: a measured JAX matmul)")
    return p.parse_args()


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def host_copy_gbs() -> float:
    """Measured memory bandwidth of this host (read + write of a 256 MiB buffer)."""
    src = np.ones(2**26, np.float32)
    dst = np.empty_like(src)
    best = min(_time_copy(src, dst) for _ in range(5))
    return 2 * src.nbytes / best / 1e9


def matmul_gflops() -> float:
    """Measured JAX matmul rate on the default device (2048^3, float32)."""
    a = jnp.ones((2048, 2048), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * 2048**3 / timed(lambda: f(a), 5) / 1e9


def _time_copy(src, dst) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def main() -> None:
    configure_xla()
    args = parse_args()
    config = ModelConfig(
        model_type=args.family, vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        qkv_bias=args.family == "qwen2", qk_norm=args.family == "qwen3",
        tie_word_embeddings=args.family in ("qwen2", "qwen3"),
        param_dtype=args.dtype, dtype=args.dtype, scan_layers=True)
    layout = load_layout(args.layout)
    mesh = make_mesh(layout)
    rules = layout.rollout_rules
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef, params = nnx.split(model)

    batch, prompt_len, new = args.batch, args.prompt_len, args.new_tokens
    slots = prompt_len + new
    rng = np.random.default_rng(0)
    ids_BxP = jnp.asarray(rng.integers(3, args.vocab, (batch, prompt_len)), jnp.int32)
    mask_BxP = jnp.ones((batch, prompt_len), bool)

    @jax.jit
    def prefill(params, ids_BxP, mask_BxP):
        with use_rules(mesh, rules):
            m = nnx.merge(graphdef, params)
            cache = KVCache.init(config, batch, slots)
            return m.extend(ids_BxP, default_positions(mask_BxP), cache, mask_BxP, last_only=True)

    @jax.jit
    def decode_step(params, token_Bx1, position_Bx1, cache):
        with use_rules(mesh, rules):
            return nnx.merge(graphdef, params).extend(token_Bx1, position_Bx1, cache)

    prefill_s = timed(lambda: prefill(params, ids_BxP, mask_BxP), args.repeats)
    _, cache = prefill(params, ids_BxP, mask_BxP)
    token_Bx1 = ids_BxP[:, -1:]
    position_Bx1 = jnp.full((batch, 1), prompt_len, jnp.int32)
    step_s = timed(lambda: decode_step(params, token_Bx1, position_Bx1, cache), args.repeats)

    # No stop tokens: every row decodes exactly `new` tokens.
    sampler = Sampler(graphdef, SamplerConfig(max_new_tokens=new, sampling=SamplingParams(1.0)),
                      mesh=mesh, rules=rules)
    prompts = Prompts(ids_BxP, mask_BxP)
    sample_s = timed(lambda: sampler.generate(params, prompts, jax.random.key(0)), args.repeats)

    itemsize = jnp.dtype(args.dtype).itemsize
    weight_bytes = config.num_params() * itemsize
    cache_bytes = 2 * config.num_layers * batch * slots * config.num_kv_heads * config.head_dim * itemsize
    step_bytes = weight_bytes + cache_bytes
    bandwidth = (args.bandwidth_gbs or host_copy_gbs()) * 1e9
    peak_flops = (args.peak_gflops or matmul_gflops()) * 1e9
    # One token per row through every weight (2 FLOPs per weight), plus q.k and p.v over the
    # whole preallocated cache, as the sampler computes them.
    step_flops = 2 * config.num_params() * batch + (
        4 * batch * slots * config.num_layers * config.num_heads * config.head_dim)
    result = {
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "mesh": dict(mesh.shape), "params": config.num_params(), "dtype": args.dtype,
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new,
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_step_ms": step_s * 1e3,
        "decode_tokens_per_s": batch / step_s,
        "sampler_tokens_per_s": batch * new / sample_s,
        "bytes_per_decode_step": step_bytes,
        "weight_bytes": weight_bytes, "kv_cache_bytes": cache_bytes,
        "achieved_gbs": step_bytes / step_s / 1e9,
        "bandwidth_gbs": bandwidth / 1e9,
        "bandwidth_bound_step_ms": step_bytes / bandwidth * 1e3,
        "fraction_of_bound": (step_bytes / bandwidth) / step_s,
        "flops_per_decode_step": step_flops,
        "matmul_gflops": peak_flops / 1e9,
        "compute_bound_step_ms": step_flops / peak_flops * 1e3,
    }
    print(f"model {config.num_params() / 1e6:.1f}M params {args.dtype}, batch {batch}, "
          f"prompt {prompt_len}, new {new}, mesh {dict(mesh.shape)} on {result['device']}")
    print(f"prefill          {result['prefill_tokens_per_s']:12,.0f} tokens/s")
    print(f"decode step      {result['decode_step_ms']:12.2f} ms  "
          f"({result['decode_tokens_per_s']:,.0f} tokens/s)")
    print(f"sampler e2e      {result['sampler_tokens_per_s']:12,.0f} tokens/s (prefill + decode loop)")
    print(f"bytes/step       {step_bytes / 2**20:12.1f} MiB  (weights {weight_bytes / 2**20:.1f} MiB "
          f"+ KV cache {cache_bytes / 2**20:.1f} MiB)")
    print(f"achieved         {result['achieved_gbs']:12.1f} GB/s of {result['bandwidth_gbs']:.1f} GB/s "
          f"-> {100 * result['fraction_of_bound']:.0f}% of the bandwidth bound "
          f"({result['bandwidth_bound_step_ms']:.2f} ms/step)")
    print(f"flops/step       {step_flops / 1e9:12.2f} GFLOP -> {step_flops / step_s / 1e9:.1f} GFLOP/s "
          f"of {peak_flops / 1e9:.0f} measured matmul GFLOP/s "
          f"(compute bound {result['compute_bound_step_ms']:.2f} ms/step)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
