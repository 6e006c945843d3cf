"""Sampler speed: prefill tokens/s, decode tokens/s, and bytes moved per decode step.

    python benchmarks/decode.py                       # a ~30M-parameter Qwen2-shaped model
    python benchmarks/decode.py --hidden 1536 --layers 28 --heads 12 --kv-heads 2 \\
        --intermediate 8960 --vocab 151936 --dtype bfloat16 --batch 64   # Qwen2.5-1.5B shape

The decode step is timed as the sampler runs it: the KV cache is donated and the returned
cache (and the greedy next token and position) feed the next call, so XLA updates the cache
in place instead of copying it each step. The timed steps stay inside the cache's slots
(`end` is reset to the prompt length when the cache fills); a step costs the same at any
`end` because attention runs over every slot, masked.

A decode step is bounded below by bytes / memory bandwidth and by FLOPs / matmul rate.
With P = `config.num_params()`, V x E the embedding table, B rows, S = prompt + new slots,
L layers, H heads, K kv heads, D head dim, and `itemsize` of --dtype:

    W     = P - V*E if the input embedding is untied (the step gathers B rows of it, a
            negligible read, and never multiplies by it), else P (tied: it is the lm_head)
    bytes = W*itemsize + 2*L*B*S*K*D*itemsize        # every weight once + the whole k/v cache
    FLOPs = 2*B*W + 4*B*S*L*H*D                      # B tokens through W; q.k and p.v over S

(Norm scales and biases are in W though they are not matmuls; activations and the float32
logits, B*V*4 bytes written, are left out: both are small next to the weights.)

The bandwidth is measured with a jitted, donated `x + 1` over a large float32 array on the
default device (bytes read + written, median of several runs), or given by --bandwidth-gbs;
the matmul rate with a jitted square matmul in --dtype (2048 on CPU, 8192 elsewhere), or
given by --peak-gflops. Both are one device's rates: on a mesh, compare per-device bytes.
Random weights; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
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
    p.add_argument("--repeats", type=int, default=5,
                   help="timed calls per measurement (decode: 4x as many single steps)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="device memory bandwidth in GB/s (default: a measured device copy)")
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


def device_copy_gbs() -> float:
    """Measured memory bandwidth of the default device: a jitted `x + 1`, input donated.

    Each call reads and writes the whole buffer (256 MiB on CPU, 2 GiB elsewhere); the
    output is fed back in so every run is a real in-place read + write. Median of 10.
    """
    n = 2**26 if jax.default_backend() == "cpu" else 2**29
    f = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = f(jnp.zeros((n,), jnp.float32))  # compile, and own the buffer
    times = []
    for _ in range(10):
        x.block_until_ready()
        start = time.perf_counter()
        x = f(x)
        x.block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times)) / 1e9


def matmul_gflops(dtype: str) -> tuple[float, int]:
    """Measured JAX matmul rate on the default device in `dtype`, and the size n (n^3)."""
    n = 2048 if jax.default_backend() == "cpu" else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / timed(lambda: f(a), 5) / 1e9, n


def time_decode(step, params, token_Bx1, position_Bx1, cache, *, start: int, slots: int,
                repeats: int, warmup: int = 2) -> float:
    """Median seconds of one `step` call, each fed the previous call's (donated) cache.

    When the cache is full, `end` and the positions go back to `start` (the prompt length),
    so every timed step writes a slot inside the cache.
    """
    times = []
    end = start
    for i in range(warmup + repeats):
        if end == slots:
            cache = cache._replace(end=jnp.asarray(start, jnp.int32))
            position_Bx1 = jnp.full_like(position_Bx1, start)
            end = start
        jax.block_until_ready((token_Bx1, position_Bx1, cache))
        t0 = time.perf_counter()
        token_Bx1, position_Bx1, cache = step(params, token_Bx1, position_Bx1, cache)
        jax.block_until_ready((token_Bx1, position_Bx1, cache))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        end += 1
    return float(np.median(times))


def main() -> None:
    configure_xla()
    args = parse_args()
    config = ModelConfig(
        model_type=args.family, vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        qkv_bias=args.family == "qwen2", qk_norm=args.family == "qwen3",
        tie_word_embeddings=args.family in ("qwen2", "qwen3"),
        param_dtype=args.dtype, compute_dtype=args.dtype, scan_layers=True)
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

    @functools.partial(jax.jit, donate_argnums=3)
    def decode_step(params, token_Bx1, position_Bx1, cache):
        """One sampler step: extend by one token per row, then pick the next greedily."""
        with use_rules(mesh, rules):
            logits_Bx1xV, cache = nnx.merge(graphdef, params).extend(token_Bx1, position_Bx1, cache)
        return jnp.argmax(logits_Bx1xV, axis=-1).astype(jnp.int32), position_Bx1 + 1, cache

    prefill_s = timed(lambda: prefill(params, ids_BxP, mask_BxP), args.repeats)
    _, cache = prefill(params, ids_BxP, mask_BxP)
    token_Bx1 = ids_BxP[:, -1:]
    position_Bx1 = jnp.full((batch, 1), prompt_len, jnp.int32)
    step_s = time_decode(decode_step, params, token_Bx1, position_Bx1, cache,
                         start=prompt_len, slots=slots, repeats=4 * args.repeats)
    del cache  # donated

    # No stop tokens: every row decodes exactly `new` tokens.
    sampler = Sampler(graphdef, SamplerConfig(max_new_tokens=new, sampling=SamplingParams(1.0)),
                      mesh=mesh, rules=rules)
    prompts = Prompts(ids_BxP, mask_BxP)
    sample_s = timed(lambda: sampler.generate(params, prompts, jax.random.key(0)), args.repeats)

    itemsize = jnp.dtype(args.dtype).itemsize
    # An untied input embedding is only gathered (B rows), never read whole or multiplied;
    # tied, it is also the lm_head and counts in full (see the module docstring).
    step_params = config.num_params() - (
        0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    weight_bytes = step_params * itemsize
    cache_bytes = 2 * config.num_layers * batch * slots * config.num_kv_heads * config.head_dim * itemsize
    step_bytes = weight_bytes + cache_bytes
    bandwidth = (args.bandwidth_gbs or device_copy_gbs()) * 1e9
    if args.peak_gflops:
        peak_flops, matmul_n = args.peak_gflops * 1e9, None
    else:
        peak_gflops, matmul_n = matmul_gflops(args.dtype)
        peak_flops = peak_gflops * 1e9
    # One token per row through every multiplied weight (2 FLOPs per weight), plus q.k and
    # p.v over the whole preallocated cache, as the sampler computes them.
    step_flops = 2 * step_params * batch + (
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
        "tie_word_embeddings": config.tie_word_embeddings,
        "achieved_gbs": step_bytes / step_s / 1e9,
        "bandwidth_gbs": bandwidth / 1e9,
        "bandwidth_bound_step_ms": step_bytes / bandwidth * 1e3,
        "fraction_of_bound": (step_bytes / bandwidth) / step_s,
        "flops_per_decode_step": step_flops,
        "matmul_gflops": peak_flops / 1e9, "matmul_size": matmul_n,
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
    print(f"achieved         {result['achieved_gbs']:12.1f} GB/s of {result['bandwidth_gbs']:.1f} GB/s copy "
          f"-> {100 * result['fraction_of_bound']:.0f}% of the bandwidth bound "
          f"({result['bandwidth_bound_step_ms']:.2f} ms/step)")
    print(f"flops/step       {step_flops / 1e9:12.2f} GFLOP -> {step_flops / step_s / 1e9:.1f} GFLOP/s "
          f"of {peak_flops / 1e9:.0f} matmul GFLOP/s ({args.dtype}) "
          f"(compute bound {result['compute_bound_step_ms']:.2f} ms/step)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
