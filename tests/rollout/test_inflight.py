"""A rollout in pieces (in-flight weight updates): with unchanged weights the pieces give the
one-piece engine's rollout token for token, every token records the weight version that drew
it, and new weights take over the live rows where a piece ends."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout.test_continuous import ROWS, assert_same_rows, engine_rollout, engine_sampler
from tests.rollout.test_sampler import LLAMA, NEW_TOKENS, policy, prompts

BIG = np.iinfo(np.int32).max  # a piece that runs to the end


def _pieces(sampler, weights, stops, seed=0, prompts_=None):
    """(rollout, version_BxC, partials): piece j decoded by weights[j] (version j) until
    stops[j] iterations in all (the test sampler's prompts by default)."""
    start = jax.jit(sampler.start_traced)
    resume = jax.jit(sampler.resume_traced)
    finish = jax.jit(sampler.finish_traced)
    partial = start(weights[0], prompts() if prompts_ is None else prompts_,
                    jax.random.key(seed), jnp.int32(0), jnp.int32(stops[0]))
    partials = [partial]
    for j, params in enumerate(weights[1:], start=1):
        partial = resume(params, partial, jnp.int32(j), jnp.int32(stops[j]))
        partials.append(partial)
    assert bool(partial.finished)
    return (*finish(partial), partials)


@pytest.mark.parametrize("slots", [ROWS, 3])
def test_pieces_with_the_same_weights_give_the_one_piece_rollout(slots):
    params = policy(*LLAMA)[1]
    rollout, version_BxC, partials = _pieces(engine_sampler(0.7, slots), [params] * 3,
                                             [2, 5, BIG])
    assert_same_rows(rollout, engine_rollout(0.7, slots), atol=0)
    assert [int(p.progress.steps) for p in partials[:2]] == [2, 5]
    assert not bool(partials[0].finished) and not bool(partials[1].finished)
    mask_BxC = np.asarray(rollout.completion_mask_BxC)
    versions = np.asarray(version_BxC)
    np.testing.assert_array_equal(versions == -1, ~mask_BxC)
    if slots == ROWS:
        # Every row decodes from the first iteration on: iteration i draws column i, the
        # prefill column 0; pieces end after iterations 2 and 5.
        want_C = np.array([0, 0, 0, 1, 1, 1, 2, 2])[:NEW_TOKENS]
        np.testing.assert_array_equal(versions, np.where(mask_BxC, want_C[None, :], -1))
    else:
        assert set(np.unique(versions[mask_BxC])) == {0, 1, 2}
        # A row's versions never go back.
        assert np.all(np.diff(np.where(mask_BxC, versions, 99), axis=1)[
            mask_BxC[:, 1:]] >= 0)


def test_new_weights_take_over_the_live_rows_where_a_piece_ends():
    old = policy(*LLAMA)[1]
    new = jax.tree.map(lambda x: x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, old)
    sampler = engine_sampler(0.7, ROWS)
    mixed, version_BxC, _ = _pieces(sampler, [old, new], [3, BIG])
    before = engine_rollout(0.7, ROWS)
    after = sampler.generate(new, prompts(), jax.random.key(0))
    # Columns 0..3 (the prefill's and 3 iterations') are the old weights' rollout.
    head = slice(0, 4)
    np.testing.assert_array_equal(mixed.completion_ids_BxC[:, head],
                                  before.completion_ids_BxC[:, head])
    np.testing.assert_array_equal(mixed.logp_raw_BxC[:, head], before.logp_raw_BxC[:, head])
    assert np.all(np.asarray(version_BxC)[:, head][np.asarray(mixed.completion_mask_BxC)[:, head]]
                  == 0)
    # Later tokens are drawn by the new weights over the old weights' cache: neither
    # weights' own rollout.
    tail = np.asarray(mixed.completion_mask_BxC)[:, 4:]
    assert tail.any() and np.all(np.asarray(version_BxC)[:, 4:][tail] == 1)
    for other in (before, after):
        assert not np.allclose(np.asarray(mixed.logp_raw_BxC)[:, 4:][tail],
                               np.asarray(other.logp_raw_BxC)[:, 4:][tail])


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)])
def test_on_a_mesh_each_device_keeps_its_own_slots_and_pool_between_pieces(mesh_shape):
    """Rows, slots and pages split over data x fsdp as the one-piece rollout splits them
    (8 devices x 1 row, or 4 x 2 with heads over tensor = 2), and kept so between pieces:
    each device's piece of the pool is its own, resumed in place; with the same weights the
    pieces give the one-piece rollout on the mesh token for token, and the single device's
    rows."""
    from jaxrl.rollout import Sampler
    from jaxrl.rollout.decode_loop import EngineConfig
    from jaxrl.rollout.inflight import partial_shardings
    from tests.rollout import test_engine as dense

    mesh, graphdef, state = dense.policy(mesh_shape)
    config = dataclasses.replace(dense.SAMPLER, engine=EngineConfig(
        max_slots=4, page_size=4, pages_per_block=2))
    sampler = Sampler(graphdef, config, mesh=mesh, rules=dense.ROLLOUT)
    rollout, version_BxC, partials = _pieces(sampler, [state] * 3, [2, 4, BIG],
                                             prompts_=dense._prompts())
    d = mesh.shape["data"] * mesh.shape["fsdp"]
    for partial in partials:
        kv = partial.progress.state.kv_pages
        assert kv.sharding.shard_shape(kv.shape)[1] == kv.shape[1] // d
        assert partial.progress.steps.shape == (d,)
        for x, want in zip(jax.tree.leaves(partial), jax.tree.leaves(
                partial_shardings(partial, mesh, dense.ROLLOUT)), strict=True):
            assert x.sharding.is_equivalent_to(want, x.ndim), (x.shape, x.sharding, want)
    assert [int(p.progress.steps.max()) for p in partials[:2]] == [2, 4]
    # The program that resumes a piece updates each device's pool in place (donated: no
    # copy of it), with no collective at all when the weights are not split (8, 1, 1).
    kv = partials[0].progress.state.kv_pages
    local = kv.sharding.shard_shape(kv.shape)
    hlo = jax.jit(sampler.resume_traced, donate_argnums=1).lower(
        state, partials[0], jnp.int32(1), jnp.int32(4)).compile().as_text()
    pool = rf"f32\[{local[0]},{local[1]},{local[2]},\d+,{local[4]}\]"
    assert re.search(pool, hlo) and not re.search(rf"= {pool}\S* copy\(", hlo)
    if mesh_shape == (8, 1, 1):
        assert not re.search(r"(all-reduce|all-gather|all-to-all|collective-permute)\(", hlo)
    assert set(np.unique(np.asarray(version_BxC)[np.asarray(rollout.completion_mask_BxC)])) \
        == {0, 1, 2}
    assert_same_rows(rollout, sampler.generate(state, dense._prompts(), jax.random.key(0)),
                     atol=0)
    assert_same_rows(rollout, dense.single_device_rollout(), atol=1e-5)
