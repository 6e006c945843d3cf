"""The asynchronous step on 4 rollout + 4 train CPU devices: staleness 0 gives the
synchronous step's numbers; staleness k trains batch n on weights min(n, k) updates old;
with in-flight weight updates later pieces of a batch are drawn by newer weights."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer
from jaxrl.rl import JaxReward, RewardSet
from jaxrl.rollout import Sampler
from jaxrl.rollout.decode_loop import EngineConfig
from jaxrl.sharding import load_layout, make_mesh
from jaxrl.sharding.submeshes import split_devices
from jaxrl.step import create_train_state
from jaxrl.step.asynchronous import QueuedRollouts
from jaxrl.step.builder import Step
from tests.step.test_builder import (
    BASE,
    CONFIG,
    OPTIM,
    REWARDS,
    SAMPLER,
    _decode,
    _inputs,
    _params,
    _run,
)

STEPS = 3
ENGINE = dataclasses.replace(SAMPLER, engine=EngineConfig(page_size=4))


@functools.cache
def _sync():
    return _run(BASE, steps=STEPS)


def _build(max_staleness, sampler_config=SAMPLER, optim=OPTIM, inflight=False,
           rewards=REWARDS):
    """(the async step on 4 rollout + 4 train devices, its initial state, the graphdef)."""
    rollout_devices, train_devices = split_devices(4)
    train_layout, rollout_layout = load_layout("fsdp"), load_layout("fsdp_tp")
    train_mesh = make_mesh(train_layout, train_devices)
    rollout_mesh = make_mesh(rollout_layout, rollout_devices)
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), optim, train_mesh,
                            train_layout.train_rules)
    graphdef, state = nnx.split(ts)
    sampler = Sampler(nnx.graphdef(ts.model), sampler_config, mesh=rollout_mesh,
                      rules=rollout_layout.rollout_rules)
    train = (train_mesh, train_layout.train_rules)
    source = QueuedRollouts(sampler, rollout=(rollout_mesh, rollout_layout.rollout_rules),
                            train=train, max_staleness=max_staleness, inflight_updates=inflight)
    step = Step(BASE, graphdef, source, rewards, optim=optim, mesh=train[0], rules=train[1])
    return step, state, graphdef


def _async(max_staleness, sampler_config=SAMPLER, optim=OPTIM, inflight=False, steps=STEPS):
    step, state, graphdef = _build(max_staleness, sampler_config, optim, inflight)
    history, params = [], []
    for n in range(steps):
        state, out = step(state, n, _inputs)
        history.append(jax.device_get(out.metrics))
        params.append(_params(nnx.merge(graphdef, state)))
    return params, history, step


def test_staleness_zero_gives_the_synchronous_steps():
    params, history, step = _async(0)
    sync_params, _, sync_history, *_ = _sync()
    for got, want in zip(history, sync_history, strict=True):
        assert got["async/staleness_max"] == 0
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 params[-1], sync_params[-1])
    assert not step.source.queue and step.source.sync_bytes > 0
    assert history[0]["async/weight_sync_bytes"] == step.source.sync_bytes


def test_staleness_one_trains_each_batch_on_weights_one_update_old():
    params, history, step = _async(1)
    assert [h["async/staleness_max"] for h in history] == [0, 1, 1]
    assert len(step.source.queue) == 1 and step.source.queue[0].step == STEPS  # made, not yet trained
    _, _, sync_history, *_ = _sync()
    # Step 0 generates and trains on the initial weights: the synchronous step 0.
    for name, value in sync_history[0].items():
        np.testing.assert_allclose(history[0][name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    # The importance weight pi_train / pi_sampler (tis_cap 2) is 1 where the sampler had the
    # trained weights, and not where it had the weights one update older.
    assert abs(history[0]["tis/weight_mean"] - 1) < 1e-5
    for h in history[1:]:
        assert abs(h["tis/weight_mean"] - 1) > 1e-4 and np.isfinite(h["loss/policy"])
    with pytest.raises(ValueError, match="called for step 5, but its queue starts at 3"):
        step.source.next(None, 5, _inputs, None)  # the queue's order, before any weights


def test_inflight_updates_with_unchanged_weights_give_the_one_piece_batches():
    """lr 1e-30 leaves every weight as it was: generating a batch in pieces, each piece with
    the weights of its step, then gives the batches made in one piece."""
    frozen = dataclasses.replace(OPTIM, lr=1e-30)
    want_params, want, _ = _async(2, ENGINE, frozen, steps=4)
    got_params, got, step = _async(2, ENGINE, frozen, inflight=True, steps=4)
    jax.tree.map(np.testing.assert_array_equal, got_params[-1], want_params[0])
    for g, w in zip(got, want, strict=True):
        for name, value in w.items():
            if not name.startswith("async/staleness"):
                np.testing.assert_allclose(g[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    # Batches 0 and 1 are made at call 0 in one piece; 2 and 3 in two pieces, the second
    # with the next step's weights: per token, 2 or 1 updates old at training.
    assert [h["async/staleness_max"] for h in got] == [0, 1, 2, 2]
    assert [h["async/staleness_mean"] for h in got][:2] == [0, 1]
    assert all(1 < h["async/staleness_mean"] < 2 for h in got[2:])
    assert step.source.piece_steps == 3


def test_inflight_updates_keep_one_batch_in_flight_and_train_on_mixed_versions():
    _, history, step = _async(2, ENGINE, inflight=True, steps=4)
    # After call 3: batch 4 finished (its last piece ran at call 3), batch 5 in flight.
    assert [(p.step, p.made) for p in step.source.queue] == [(4, True), (5, False)]
    versions = np.asarray(step.source.queue[0].version_BxC)
    mask = np.asarray(step.source.queue[0].rollout.completion_mask_BxC)
    assert set(np.unique(versions[mask])) <= {2, 3} and 3 in versions[mask]
    assert np.all(versions[~mask] == -1)
    for h in history[1:]:  # the sampler's weights were older than the trained ones
        assert abs(h["tis/weight_mean"] - 1) > 1e-4 and np.isfinite(h["loss/policy"])
    with pytest.raises(ValueError, match="inflight_updates needs max_staleness >= 2"):
        _async(1, ENGINE, inflight=True, steps=0)


def test_a_failure_on_either_side_says_which_side_and_stops_the_step():
    step, state, _ = _build(1)

    def batch_of(m):  # the rollout side's input fails for batch 2 (made at call 1)
        if m == 2:
            raise OSError("prompt file vanished")
        return _inputs(m)

    state, _ = step(state, 0, batch_of)
    with pytest.raises(OSError, match="prompt file vanished") as failed:
        step(state, 1, batch_of)
    assert failed.value.__notes__ == [
        "async: the rollout side failed at step 1 (making batch 2); the train side stops "
        "too, its last update was step 0's"]

    def broken(inputs):  # an in-graph reward with a bug: the train program fails to build
        raise KeyError("answer")

    step, state, _ = _build(2, rewards=RewardSet([JaxReward("broken", broken)],
                                                 decode=_decode))
    with pytest.raises(KeyError, match="answer") as failed:
        step(state, 0, _inputs)
    assert failed.value.__notes__[-1:] == [  # after JAX's note on its filtered traceback
        "async: the train side failed at step 0; the rollout side stops too, its batches "
        "made ahead (steps 1..2) untrained"]
