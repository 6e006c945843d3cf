"""Sampler speed: a whole rollout (prefill + decode loop) of fixed or long-tailed lengths under
dense, static or continuous batching, its bytes and FLOPs per decode step against their bounds,
and the micro measurements (prefill tokens/s, one dense decode step).

    python benchmarks/decode.py                       # a ~30M-parameter Qwen2-shaped model
    python benchmarks/decode.py --lengths longtail --max-new-tokens 256 --batch 64 \\
        --batching continuous --slots 16 --json       # long-tailed lengths, 16 engine slots
    python benchmarks/decode.py --hidden 1536 --layers 28 --heads 12 --kv-heads 2 \\
        --intermediate 8960 --vocab 151936 --dtype bfloat16 --batch 64   # Qwen2.5-1.5B shape
    python benchmarks/decode.py --devices 8 --layout fsdp --json   # 8 fake CPU devices

--devices N: N fake CPU devices (set before JAX starts). On a mesh the engine splits rows,
slots and their pages over the layout's batch axes (`decode_loop.rollout_on_mesh`):
`kv_bytes_per_device` is the KV pool one device allocates, read off the compiled program
(its partitioned HLO: the largest [layers, pages, page_size, 2K, head_dim] buffer).

Workload: B = --batch prompts of P = --prompt-len random tokens, one sample each, sampled at
temperature 1 with no stop tokens (EOS ignored), so row r generates exactly C_r new tokens.
`--lengths fixed`: C_r = T (--max-new-tokens). `longtail`: C_r = clip(round(X_r), 1, T), X_r
log-normal with median --length-median (mu = ln median) and sigma --length-sigma, drawn with
numpy default_rng(0): the same limits for every batching.

Batchings: `dense` is `SamplerConfig(engine=None)` (`jaxrl.rollout.dense_reference`):
it has no per-row limits, so every row decodes T tokens over a [B, P + T - 1] cache, and only
the C_r useful tokens of each row count as generated. `static` / `continuous` run the engine
(`jaxrl.rollout.slots`, `decode_loop`) with S = --slots decode slots (default B; the engine takes at
least 2) over a pool of --page-size-token pages and per-row limits C_r: static starts a batch
of S rows only when every slot is free, continuous refills a slot as soon as its row ends
(and with --min-slots M, once no row waits, moves the live rows into half the slots whenever
they fit, down to M; `auto`, the default, is the engine's default: `slot_count.tail_min_slots`,
`min_slots_resolved` in the JSON; `none`: never).

Timed: the compiled `Sampler.generate` program (prefill + decode loop + sampling), median of
--repeats calls after a checked warm-up call. tokens_per_s = sum_r C_r / rollout_s. A decode
iteration is one one-token forward pass of the loop (each row's first token is sampled from
the prefill logits, in no iteration): dense N = T - 1; engine N = the `lax.while_loop` trips
of `decode_loop.rollout`, from replaying its admission rule on the limits (`engine_schedule`;
--check-schedule also runs `rollout` under jit and asserts it). decode_step_s = rollout_s / N
includes the prefill (prefill_s, the micro measurement's, is beside), so it bounds a step above.

Bytes and FLOPs per decode step. P_m = `config.num_params()`, V x E the embedding table, L
layers, H heads, K kv heads, D head dim, `itemsize` of --dtype, kv = 2*L*K*D*itemsize bytes
per cached token (keys and values of every layer):

    W      = P_m - V*E if the input embedding is untied (a step gathers B rows of it and never
             multiplies by it), else P_m (tied: it is also the lm_head)
    dense  bytes = W*itemsize + kv*B*(P + T - 1)      every weight + the whole preallocated cache
           FLOPs = 2*B*W + 4*B*(P + T - 1)*L*H*D      (attention runs over every slot, masked)
    engine bytes = W*itemsize + kv*A                  A = live tokens per iteration, on average
           FLOPs = 2*S'*W + 4*A*L*H*D                 S' = slot steps / N: every slot goes through
                                                      W, live or not (S' = S without halving)

A row with limit C is live for C - 1 iterations, attending over n + 1, ..., n + C - 1 tokens
(n = P its prompt), so A = sum_r [(C_r - 1) P + C_r (C_r - 1) / 2] / N: only N depends on
the batching. The engine's XLA attention path reads more than A per iteration: whole blocks
of `pages_per_block` pages, for chunks of C slots (`paged_attention.chunk_slots`) at a time:
block i for ceil(live_i / C) chunks, live_i the slots reaching it (kv_gathered_bytes_per_step). roofline_frac = bytes / bandwidth / decode_step_s;
compute_frac = FLOPs / matmul rate / decode_step_s. Norm scales and biases are in W though
they are not matmuls; activations and the float32 logits (B*V*4 bytes) are left out.
peak_memory_bytes: XLA's plan for the rollout program (arguments + outputs - donated +
temporaries, `jaxrl.perf.memory`).

Micro measurements (--no-micro skips them): prefill tokens/s of the B prompts, and one dense
decode step over a [B, P + T] cache (the dense equations with P + T slots), timed as the
sampler runs it: the cache is donated and each call's outputs feed the next (`time_decode`).

The bandwidth is measured with a jitted, donated `x + 1` over a large float32 array on the
default device (bytes read + written, median of several runs), or given by --bandwidth-gbs;
the matmul rate with a jitted square matmul in --dtype (2048 on CPU, 8192 elsewhere), or
given by --peak-gflops. Both are one device's rates: on a mesh, compare per-device bytes.
Random weights; nothing is downloaded. --json: the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time

if "--devices" in sys.argv:  # before JAX starts: it reads the device count once
    _n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={_n}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import KVCache, ModelConfig, Transformer, default_positions
from jaxrl.models.paged_attention import chunk_slots
from jaxrl.perf.memory import program_memory
from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams
from jaxrl.rollout.decode_loop import EngineConfig
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.slot_count import max_concurrent_decodes, slot_tiers, tail_min_slots
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
    p.add_argument("--batch", type=int, default=16, help="rows (prompts, one sample each)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", "--new-tokens", dest="max_new_tokens", type=int,
                   default=64, help="the most new tokens of a row (T)")
    p.add_argument("--batching", default="continuous", choices=["dense", "static", "continuous"],
                   help="dense: today's sampler; static/continuous: the engine")
    p.add_argument("--lengths", default="fixed", choices=["fixed", "longtail"])
    p.add_argument("--length-median", type=float, default=32.0)
    p.add_argument("--length-sigma", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=None, help="engine slots (default: --batch)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--min-slots", type=min_slots_arg, default="auto",
                   help="continuous: once no row waits, halve the slots down to this "
                        "(auto: the engine's default; none: never)")
    p.add_argument("--layout", default="fsdp", help="preset or YAML; weights use its rollout rules")
    p.add_argument("--devices", type=int, default=None,
                   help="run on this many fake CPU devices (default: the backend's devices)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed calls per measurement (dense step: 4x as many single steps)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="device memory bandwidth in GB/s (default: a measured device copy)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="device matmul rate in GFLOP/s (default: a measured JAX matmul)")
    p.add_argument("--no-micro", dest="micro", action="store_false",
                   help="skip the prefill and single dense decode step measurements")
    p.add_argument("--check-schedule", action="store_true",
                   help="also run decode_loop.rollout under jit and assert its iteration count")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args()


def min_slots_arg(text: str) -> int | str | None:
    """--min-slots: `auto`, `none` or a slot count."""
    if text.isdigit():
        return int(text)
    if text.lower() not in ("auto", "none"):
        raise argparse.ArgumentTypeError(f"expected auto, none or a slot count, got {text!r}")
    return None if text.lower() == "none" else "auto"


def timed(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` after `warmup` untimed calls."""
    for _ in range(warmup):
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
    """Median seconds of one `step` call, each fed the previous call's (donated) cache, so XLA
    updates it in place. When the cache is full, `end` and the positions go back to `start`
    (the prompt length): every step writes inside the cache, and costs the same at any `end`
    (attention runs over every slot, masked)."""
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


def row_limits(args: argparse.Namespace) -> np.ndarray:
    """C_r of every row (module docstring), int32 [B]."""
    t = args.max_new_tokens
    if args.lengths == "fixed":
        return np.full((args.batch,), t, np.int32)
    x = np.random.default_rng(0).lognormal(np.log(args.length_median), args.length_sigma,
                                           args.batch)
    return np.clip(np.rint(x), 1, t).astype(np.int32)


def engine_schedule(limits_B: np.ndarray, prompt_len: int, slots: int, batching: str,
                    tokens_per_block: int, min_slots: int | None = None,
                    ) -> tuple[int, int, int, int]:
    """(N, slot steps, live tokens summed over the N iterations, tokens the XLA attention
    path gathers): `decode_loop.rollout`'s loop replayed on the host, for prompts of
    `prompt_len` tokens and a pool that holds every slot's worst case (its default: no row
    waits for pages). Rows with C_r = 1 end on their prefill token; the others queue in row
    order. An iteration admits queued rows into free slots (static: only when all are free),
    then every live slot decodes one token; a row ends when it has C_r tokens, its slot free
    the next iteration. With `min_slots`, once the queue is empty the slot count halves
    whenever the live rows fit (`slot_count.slot_tiers`)."""
    queue = [int(c) for c in limits_B if c > 1]
    tiers = slot_tiers(slots, min_slots)
    limit_S, t_S = np.zeros(slots, int), np.zeros(slots, int)
    live_S = np.zeros(slots, bool)
    taken = steps = slot_steps = live_tokens = gathered = tier = 0
    while taken < len(queue) or live_S.any():
        while (tier + 1 < len(tiers) and taken == len(queue)
               and live_S.sum() <= tiers[tier + 1]):
            tier += 1
            keep = np.argsort(~live_S, kind="stable")[:tiers[tier]]
            limit_S, t_S, live_S = limit_S[keep], t_S[keep], live_S[keep]
        free_S = ~live_S & (batching == "continuous" or not live_S.any())
        for s in np.flatnonzero(free_S)[:len(queue) - taken]:
            limit_S[s], t_S[s], live_S[s] = queue[taken], 1, True
            taken += 1
        length_S = prompt_len + t_S[live_S]  # tokens each live slot attends over
        live_tokens += int(length_S.sum())
        # The XLA path gathers block i for ceil(live_i / C) chunks of C slots (live_i: the
        # slots reaching block i; `paged_attention.chunk_slots`).
        blocks_S = -(-length_S // tokens_per_block)
        chunk = chunk_slots(len(live_S))
        gathered += sum(-(-int((blocks_S > i).sum()) // chunk) * chunk * tokens_per_block
                        for i in range(int(blocks_S.max())))
        slot_steps += len(live_S)
        t_S += 1
        live_S &= t_S < limit_S
        steps += 1
    return steps, slot_steps, live_tokens, gathered


def row_shards(mesh, rules, batch: int) -> int:
    """How many ways the engine splits the rows (`decode_loop.rollout_on_mesh`'s rule)."""
    axes = tuple(a for a in rules.mesh_axes("batch") if mesh.shape.get(a, 1) > 1)
    while axes and batch % np.prod([mesh.shape[a] for a in axes]):
        axes = axes[:-1]
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def pool_bytes(hlo: str, config, dtype: str, page_size: int) -> int | None:
    """Bytes of the KV pool one device allocates: the largest [layers, pages, page_size, 2K',
    head_dim] buffer of a compiled (partitioned, per-device) program's HLO text (K' the kv
    heads a device holds); None when there is none (the dense sampler)."""
    name = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    item = 4 if dtype == "float32" else 2
    best = None
    for dims in re.findall(rf"{name}\[(\d+),(\d+),(\d+),(\d+),(\d+)\]", hlo):
        layers, pages, page, heads, head_dim = map(int, dims)
        if (layers, page, head_dim) == (config.num_layers, page_size, config.head_dim) and (
                heads % 2 == 0 and heads <= 2 * config.num_kv_heads):
            size = layers * pages * page * heads * head_dim * item
            best = size if best is None else max(best, size)
    return best


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
    mesh, rules = make_mesh(layout), layout.rollout_rules
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef, params = nnx.split(model)

    batch, prompt_len, new = args.batch, args.prompt_len, args.max_new_tokens
    rng = np.random.default_rng(0)
    ids_BxP = jnp.asarray(rng.integers(3, args.vocab, (batch, prompt_len)), jnp.int32)
    mask_BxP = jnp.ones((batch, prompt_len), bool)
    limits_B = row_limits(args)
    generated = int(limits_B.sum())

    itemsize = jnp.dtype(args.dtype).itemsize
    # An untied input embedding is only gathered (B rows), never read whole or multiplied;
    # tied, it is also the lm_head and counts in full (see the module docstring).
    step_params = config.num_params() - (
        0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    weight_bytes = step_params * itemsize
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    attn_token_flops = 4 * config.num_layers * config.num_heads * config.head_dim
    bandwidth = (args.bandwidth_gbs or device_copy_gbs()) * 1e9
    if args.peak_gflops:
        peak_flops, matmul_n = args.peak_gflops * 1e9, None
    else:
        peak_gflops, matmul_n = matmul_gflops(args.dtype)
        peak_flops = peak_gflops * 1e9

    # ------------------------------------------------------------ the whole rollout
    dense = args.batching == "dense"
    if dense:
        engine, slots, limits = None, batch, None
    else:
        engine = EngineConfig(max_slots=args.slots or batch, page_size=args.page_size,
                              batching=args.batching, min_slots=args.min_slots)
        local_min_slots = None  # the halving's floor each device runs with (below)
        slots = max_concurrent_decodes(engine, batch)
        limits = jnp.asarray(limits_B)
    sampler = Sampler(graphdef, SamplerConfig(max_new_tokens=new, sampling=SamplingParams(1.0),
                                              engine=engine), mesh=mesh, rules=rules)
    prompts, key = Prompts(ids_BxP, mask_BxP), jax.random.key(0)
    compiled = jax.jit(sampler.generate_traced).lower(params, prompts, key, limits).compile()
    memory = program_memory("rollout", compiled)
    kv_bytes_per_device = None if dense else pool_bytes(
        compiled.as_text(), config, args.dtype, min(args.page_size, prompt_len + new - 1))
    out = compiled(params, prompts, key, limits)  # the warm-up call, checked
    expected = batch * new if dense else generated
    if (filled := int(jnp.sum(out.completion_mask_BxC))) != expected:
        raise AssertionError(f"the rollout generated {filled} tokens, expected {expected}")
    rollout_s = timed(lambda: compiled(params, prompts, key, limits), args.repeats, warmup=0)

    if dense:
        iterations = new - 1
        kv_tokens = kv_gathered = batch * (prompt_len + new - 1)  # the whole cache, each step
        step_flops = 2 * step_params * batch + attn_token_flops * kv_tokens
    else:
        pool = PoolLayout.plan(page_size=args.page_size, num_prompts=batch,
                               prompt_len=prompt_len, max_new_tokens=new, num_slots=slots)
        tokens_per_block = min(engine.pages_per_block, pool.table_width) * pool.page_size
        # Each device of the batch axes runs its own rows with its share of the slots.
        shards = row_shards(mesh, rules, batch)
        local_slots = max(2, -(-slots // shards)) if shards > 1 else slots
        local_min_slots = tail_min_slots(engine, local_slots, new)
        per_device = [engine_schedule(part, prompt_len, local_slots, args.batching,
                                      tokens_per_block, local_min_slots)
                      for part in np.split(limits_B, shards)]
        iterations = max(x[0] for x in per_device)
        slot_steps, live_sum, gathered_sum = (sum(x[i] for x in per_device) for i in (1, 2, 3))
        if args.check_schedule:
            check_schedule(graphdef, params, engine, prompts, limits, new,
                           (iterations, slot_steps), mesh, rules)
        kv_tokens = live_sum / max(iterations, 1)
        kv_gathered = gathered_sum / max(iterations, 1)
        step_flops = (2 * step_params * slot_steps / max(iterations, 1)
                      + attn_token_flops * kv_tokens)
    step_bytes = weight_bytes + kv_token_bytes * kv_tokens
    step_s = rollout_s / iterations if iterations else None
    result = {
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "mesh": dict(mesh.shape), "params": config.num_params(), "dtype": args.dtype,
        "batching": args.batching, "lengths": args.lengths,
        "length_median": args.length_median if args.lengths == "longtail" else None,
        "length_sigma": args.length_sigma if args.lengths == "longtail" else None,
        "batch": batch, "slots": slots, "min_slots": None if dense else args.min_slots,
        "min_slots_resolved": None if dense else local_min_slots,
        "decode_slot_steps": batch * (new - 1) if dense else slot_steps, "page_size": None if dense else args.page_size,
        "prompt_len": prompt_len, "max_new_tokens": new,
        "generated_tokens": generated, "limit_mean": float(limits_B.mean()),
        "limit_max": int(limits_B.max()),
        "rollout_s": rollout_s, "tokens_per_s": generated / rollout_s,
        "decode_iterations": iterations, "decode_step_s": step_s,
        "bytes_per_step": step_bytes, "weight_bytes": weight_bytes,
        "kv_bytes_per_step": kv_token_bytes * kv_tokens,
        "kv_gathered_bytes_per_step": kv_token_bytes * kv_gathered,
        "bandwidth_gbs": bandwidth / 1e9,
        "roofline_frac": step_bytes / bandwidth / step_s if step_s else None,
        "flops_per_step": step_flops, "matmul_gflops": peak_flops / 1e9, "matmul_size": matmul_n,
        "compute_frac": step_flops / peak_flops / step_s if step_s else None,
        "kv_bytes_per_device": kv_bytes_per_device,
        "peak_memory_bytes": memory.peak_bytes if memory else None,
        "memory_temp_bytes": memory.temp_bytes if memory else None,
        "memory_argument_bytes": memory.argument_bytes if memory else None,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    if args.micro:
        result.update(micro(args, config, graphdef, params, mesh, rules, ids_BxP, mask_BxP,
                            step_params, weight_bytes, kv_token_bytes, attn_token_flops,
                            bandwidth, peak_flops))
    report(result)
    if args.json:
        print(json.dumps(result))  # the last line


def check_schedule(graphdef, params, engine, prompts, limits, new, expected, mesh, rules):
    """Runs `decode_loop.rollout` under jit and asserts its (iterations, slot steps)."""
    from jaxrl.rollout.decode_loop import rollout

    @jax.jit
    def steps(params, ids_BxP, mask_BxP, limit_B):
        with use_rules(mesh, rules):
            keys = jax.random.split(jax.random.key(0), ids_BxP.shape[0])
            return rollout(nnx.merge(graphdef, params), ids_BxP, mask_BxP, keys, limit_B, new,
                           engine, end_token_ids=(), pad_token_id=0,
                           sampling=SamplingParams(1.0))[1:]

    if (got := tuple(int(x) for x in steps(params, *prompts, limits))) != expected:
        raise AssertionError(f"decode_loop.rollout ran (iterations, slot steps) {got}; the "
                             f"replay: {expected}")


def micro(args, config, graphdef, params, mesh, rules, ids_BxP, mask_BxP, step_params,
          weight_bytes, kv_token_bytes, attn_token_flops, bandwidth, peak_flops) -> dict:
    """Prefill tokens/s and one dense decode step over a [B, P + T] cache (module docstring)."""
    batch, prompt_len = ids_BxP.shape
    slots = prompt_len + args.max_new_tokens

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
    step_s = time_decode(decode_step, params, ids_BxP[:, -1:],
                         jnp.full((batch, 1), prompt_len, jnp.int32), cache,
                         start=prompt_len, slots=slots, repeats=4 * args.repeats)
    del cache  # donated
    step_bytes = weight_bytes + kv_token_bytes * batch * slots
    step_flops = 2 * step_params * batch + attn_token_flops * batch * slots
    return {"prefill_s": prefill_s, "prefill_tokens_per_s": batch * prompt_len / prefill_s,
            "dense_step_s": step_s, "dense_step_tokens_per_s": batch / step_s,
            "dense_step_bytes": step_bytes, "dense_step_flops": step_flops,
            "dense_step_roofline_frac": step_bytes / bandwidth / step_s,
            "dense_step_compute_frac": step_flops / peak_flops / step_s}


def report(r: dict) -> None:
    """The human-readable summary (the JSON object, with --json, comes after it)."""
    mib = 2**20
    lengths = (f"longtail (median {r['length_median']:g}, sigma {r['length_sigma']:g})"
               if r["lengths"] == "longtail" else "fixed")
    print(f"model {r['params'] / 1e6:.1f}M params {r['dtype']}, batch {r['batch']}, prompt "
          f"{r['prompt_len']}, max new {r['max_new_tokens']}, mesh {r['mesh']} on {r['device']}"
          f"\nworkload         {lengths}: {r['generated_tokens']:,} tokens (mean "
          f"{r['limit_mean']:.1f}, max {r['limit_max']} per row)")
    print(f"rollout          {r['batching']}, {r['slots']} slots: {r['rollout_s']:.3f} s -> "
          f"{r['tokens_per_s']:,.0f} generated tokens/s")
    if r["decode_step_s"]:
        print(f"decode step      {r['decode_step_s'] * 1e3:12.2f} ms over {r['decode_iterations']} "
              f"iterations (prefill included)\n"
              f"bytes/step       {r['bytes_per_step'] / mib:12.1f} MiB  (weights "
              f"{r['weight_bytes'] / mib:.1f} + KV {r['kv_bytes_per_step'] / mib:.1f}; gathered KV "
              f"{r['kv_gathered_bytes_per_step'] / mib:.1f}) -> {100 * r['roofline_frac']:.0f}% "
              f"of {r['bandwidth_gbs']:.1f} GB/s\n"
              f"flops/step       {r['flops_per_step'] / 1e9:12.2f} GFLOP -> "
              f"{100 * r['compute_frac']:.0f}% of {r['matmul_gflops']:.0f} matmul GFLOP/s")
    if r["kv_bytes_per_device"] is not None:
        print(f"KV pool          {r['kv_bytes_per_device'] / mib:12.2f} MiB per device")
    if r["peak_memory_bytes"] is not None:
        print(f"memory           {r['peak_memory_bytes'] / mib:12.1f} MiB peak of the rollout "
              f"program (temporaries {r['memory_temp_bytes'] / mib:.1f} MiB)")
    if "prefill_tokens_per_s" in r:
        print(f"prefill          {r['prefill_tokens_per_s']:12,.0f} tokens/s\n"
              f"dense step       {r['dense_step_s'] * 1e3:12.2f} ms "
              f"({r['dense_step_tokens_per_s']:,.0f} tokens/s; {r['dense_step_bytes'] / mib:.1f} "
              f"MiB -> {100 * r['dense_step_roofline_frac']:.0f}% of bandwidth, "
              f"{100 * r['dense_step_compute_frac']:.0f}% of matmul rate)")


if __name__ == "__main__":
    main()
