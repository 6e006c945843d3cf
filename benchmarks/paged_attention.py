"""The paged decode attention's XLA path alone: one layer's `ragged_decode_attention` call.

    python benchmarks/paged_attention.py [--slots 64] [--tokens 128] [--kv-heads 2]
        [--group 2] [--head-dim 64] [--page-size 16] [--calls 50] [--rounds 3]

Workload: a random pool of 4 layers (float32) with every slot's pages drawn at random, one
query per slot, slot lengths uniform in [tokens / 4, tokens]; the page table is exactly
--tokens / --page-size pages wide, so one block covers it (no loop). Timed: --calls calls of
the jitted function after a warm-up call, per round; prints ms per call for each round. Run
it against another checkout with `PYTHONPATH=<checkout> python benchmarks/paged_attention.py`
to compare versions in one sitting.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.paged_attention import ragged_decode_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--group", type=int, default=2, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tokens % args.page_size:
        parser.error(f"--tokens={args.tokens} must be a multiple of --page-size="
                     f"{args.page_size}")
    s, k, h = args.slots, args.kv_heads, args.head_dim
    width = args.tokens // args.page_size
    num_pages = s * width + 1
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((4, num_pages, args.page_size, 2 * k, h)),
                       jnp.float32)
    table = jnp.asarray(rng.permutation(num_pages - 1)[:s * width].reshape(s, width),
                        jnp.int32)
    length = jnp.asarray(rng.integers(args.tokens // 4, args.tokens + 1, s), jnp.int32)
    q = jnp.asarray(rng.standard_normal((s, k * args.group, h)), jnp.float32)
    attend = jax.jit(functools.partial(ragged_decode_attention, scale=h ** -0.5,
                                       pages_per_block=width))
    attend(q, pool, 1, table, length).block_until_ready()
    for r in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.calls):
            out = attend(q, pool, 1, table, length)
        out.block_until_ready()
        ms = (time.perf_counter() - start) / args.calls * 1e3
        print(f"round {r + 1}: {ms:.2f} ms per call ({s} slots x {args.tokens} tokens, "
              f"{k} kv heads x {args.group} queries, head dim {h})")


if __name__ == "__main__":
    main()
