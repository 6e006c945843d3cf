"""A rollout in pieces (in-flight weight updates): with unchanged weights the pieces give the
one-piece engine's rollout token for token, every token records the weight version that drew
it, and new weights take over the live rows where a piece ends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout.test_continuous import ROWS, assert_same_rows, engine_rollout, engine_sampler
from tests.rollout.test_sampler import LLAMA, NEW_TOKENS, policy, prompts

BIG = np.iinfo(np.int32).max  # a piece that runs to the end


def _pieces(sampler, weights, stops, seed=0):
    """(rollout, version_BxC, partials): piece j decoded by weights[j] (version j) until
    stops[j] iterations in all."""
    start = jax.jit(sampler.start_traced)
    resume = jax.jit(sampler.resume_traced)
    finish = jax.jit(sampler.finish_traced)
    partial = start(weights[0], prompts(), jax.random.key(seed), jnp.int32(0),
                    jnp.int32(stops[0]))
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
