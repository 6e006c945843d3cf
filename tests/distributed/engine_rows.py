"""The RL engine's rows on a given mesh, for tests/distributed/test_engine_rows.py: a tiny
policy created in the fsdp layout samples 8 prompts x 3 with the engine (continuous batching,
8 slots, per-row limits) through `Sampler.generate`, as the RL step does.

    rows(devices)   in this process, on a mesh over `devices` (default: all)
    python -m tests.distributed.engine_rows OUT.npz   in every process of a jax.distributed
                    run (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; gloo, as
                    `jaxrl.distributed.initialize` joins); process 0 writes the rows

Imports no test configuration (tests/conftest.py would force 8 devices on every process) and
touches no JAX backend on import (a `ModelConfig` reads it), so `main` can join the run first.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models import Transformer
from jaxrl.models.config import tiny_config
from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams
from jaxrl.rollout.decode_loop import EngineConfig, row_shards
from jaxrl.sharding import create_sharded, load_layout, make_mesh

PROMPT_LENGTHS = (6, 3, 5, 2, 4, 6, 1, 3)  # 8 prompts x 3 samples: 24 rows, 3 per device of 8
GROUP, NEW_TOKENS = 3, 8
# 8 slots on one device (rows wait for a free slot), 2 per device of 8 (3 rows each): every
# device refills a slot; top-k and top-p so that the sort is covered too.
SAMPLER = SamplerConfig(max_new_tokens=NEW_TOKENS, num_generations=GROUP,
                        sampling=SamplingParams(0.7, top_k=20, top_p=0.95),
                        engine=EngineConfig(max_slots=8, page_size=4, pages_per_block=2))
# Each row's cap on new tokens, 2..8 (no stop tokens: each row ends at its own).
LIMITS = np.random.default_rng(2).integers(2, NEW_TOKENS + 1, len(PROMPT_LENGTHS) * GROUP,
                                           dtype=np.int32)
FIELDS = ("completion_ids_BxC", "completion_mask_BxC", "logp_BxC", "logp_raw_BxC")


def _sharpen(path, x):
    # As tests/rollout/test_engine.py: larger layer weights and 20x logits, so that the tokens
    # depend on the context (a near-uniform policy would hide a wrong attention read).
    if path[0].key == "final_norm":
        return x * 20.0
    return x * 5.0 if path[0].key == "layers" and path[-1].key != "scale" else x


def _prompts(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids and their mask, on the host."""
    rng = np.random.default_rng(1)
    width = max(PROMPT_LENGTHS)
    mask = np.arange(width)[None, :] >= width - np.asarray(PROMPT_LENGTHS)[:, None]
    ids = np.where(mask, rng.integers(2, vocab_size, (len(PROMPT_LENGTHS), width)), 0)
    return ids.astype(np.int32), mask


def rows(devices=None) -> dict[str, np.ndarray]:
    """Every row's tokens, mask and log-probs (host arrays, all rows on every process), and
    the mesh's `shape` and the `row_shards` the engine split the rows into."""
    layout, config = load_layout("fsdp"), tiny_config("llama")
    mesh = make_mesh(layout, devices)
    graphdef, state = nnx.split(create_sharded(
        lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, layout.train_rules))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(
        _sharpen, nnx.to_pure_dict(state)))
    replicated = NamedSharding(mesh, P())
    ids, mask, limits = (jax.device_put(x, replicated)
                         for x in (*_prompts(config.vocab_size), LIMITS))
    key = jax.jit(lambda: jax.random.key(0), out_shardings=replicated)()  # on every process
    sampler = Sampler(graphdef, SAMPLER, mesh=mesh, rules=layout.rollout_rules)
    out = sampler.generate(state, Prompts(ids, mask), key, limits)
    got = {f: np.asarray(multihost_utils.process_allgather(getattr(out, f), tiled=True))
           for f in FIELDS}
    num_rows = len(PROMPT_LENGTHS) * GROUP
    return {**got, "mesh": np.asarray([mesh.shape[a] for a in mesh.axis_names]),
            "row_shards": np.asarray(row_shards(mesh, layout.rollout_rules, num_rows)),
            "processes": np.asarray(jax.process_count())}


def main(path: str) -> None:
    from jaxrl.distributed import initialize
    from jaxrl.distributed.settings import DistributedSection
    from jaxrl.perf.compiler import unroll_cpu_threefry
    from jaxrl.runtime import configure_xla

    configure_xla()  # as the jaxrl command (and tests/conftest.py) does
    unroll_cpu_threefry()
    initialize(DistributedSection(), preemption=False)
    got = rows()
    if jax.process_index() == 0:
        np.savez(path, **got)


if __name__ == "__main__":
    main(sys.argv[1])
