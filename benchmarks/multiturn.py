"""Could the fused one-program step hold a multi-turn rollout? The price of the host per token.

    python benchmarks/multiturn.py                  # ~1 minute on 2 cores
    python benchmarks/multiturn.py --slots 64 --steps 100

A multi-turn rollout needs the host (the environments) in the middle of decoding. A fused
program could only reach it through a host callback (`jax.experimental.io_callback`) inside
its decode loop, at every iteration, since any slot may end its turn at any token. This
times one decode iteration of the engine's slots (`rollout.serving.emit_and_generate`,
a random quickstart-sized policy, --slots slots) three ways, each over --steps iterations,
alternated --rounds times, median:

    in_program    a jitted fori_loop of decode steps: no host at all (the single-turn engine)
    callback      the same loop with an ordered io_callback at every iteration that hands
                  the slots' tokens to the host and gets a value back that the loop uses (what
                  a fused multi-turn program would have to do at least)
    host_loop     one jitted decode step per Python call, its tokens read on the host after
                  each (what `jaxrl.step.multiturn_rollout` does; it also overlaps: it dispatches
                  step k+1 before reading step k)

Prints one JSON line per way: milliseconds per decode iteration and the ratio to in_program.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jaxrl.models import ModelConfig, Transformer
from jaxrl.rollout import serving, slots
from jaxrl.rollout.sampling import SamplingParams


def _model() -> Transformer:
    config = ModelConfig(model_type="qwen2", vocab_size=20, hidden_size=64, intermediate_size=256,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=True)
    return Transformer(config, rngs=nnx.Rngs(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = _model()
    graphdef, weights = nnx.split(model)
    layout = serving.pool_layout(args.slots, 16, args.steps + 2, 16)
    stops = slots.Stops()  # no stop token: every slot decodes every step
    sampling = SamplingParams(temperature=1.0)

    def fresh_state():
        """Every slot holding a row of an 8-token prompt (its home: the slot)."""
        s = args.slots
        state = slots.init(model.config, layout, s)
        ints, floats = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.float32)
        return slots.insert(state, layout, slots.Starts(
            jnp.arange(s), jnp.arange(s), jnp.full((s,), 8), ints, floats, floats,
            jnp.zeros_like(state.key_SxK), jnp.full((s,), args.steps + 2)), stops)

    def decode(weights, state):
        return serving.emit_and_generate(nnx.merge(graphdef, weights), state, layout, stops,
                                         sampling, slots.PagedAttentionSettings())

    seen = []

    def host(token_S):  # the host sees the tokens and answers: one value the loop adds back
        seen.append(int(token_S[0]))
        return np.zeros((), np.int32)

    @jax.jit
    def in_program(weights, state):
        def body(_, state):
            return decode(weights, state)[0]
        return jax.lax.fori_loop(0, args.steps, body, state)

    @jax.jit
    def callback(weights, state):
        def body(_, state):
            state, out = decode(weights, state)
            answer = io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), out.token_S,
                                 ordered=True)
            return state.replace(token_S=state.token_S + answer)
        return jax.lax.fori_loop(0, args.steps, body, state)

    one_step = jax.jit(decode)

    def host_loop(weights, state):
        for _ in range(args.steps):
            state, out = one_step(weights, state)
            np.asarray(out.token_S)
        return state

    ways = {"in_program": in_program, "callback": callback, "host_loop": host_loop}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():  # compile and warm up
        jax.block_until_ready(fn(weights, fresh_state()))
    for _ in range(args.rounds):
        for name, fn in ways.items():
            state = fresh_state()
            jax.block_until_ready(state)
            start = time.perf_counter()
            jax.block_until_ready(fn(weights, state))
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(times["in_program"])
    for name in ways:
        ms = statistics.median(times[name])
        print(json.dumps({"way": name, "slots": args.slots, "steps": args.steps,
                          "ms_per_iteration": round(ms, 3), "vs_in_program": round(ms / base, 2),
                          "rounds_ms": [round(t, 3) for t in times[name]]}))


if __name__ == "__main__":
    main()
