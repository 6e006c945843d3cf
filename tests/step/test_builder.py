"""The RL step: fused ≡ split, grad accumulation ≡ full batch, sharded ≡ single device, one
compilation, and the number of optimizer updates; on a tiny random policy with random prompts,
a JAX reward and a Python reward (so the host callback and `score_host` both run).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.models import Transformer
from jaxrl.rl import JaxReward, PolicyLossConfig, PythonReward, RewardSet
from jaxrl.rollout import Prompts, Rollout, Sampler, SamplerConfig
from jaxrl.sharding import load_layout, make_mesh
from jaxrl.step import create_train_state, reference_params
from jaxrl.step.builder import build_step
from jaxrl.step.forward import prompt_group
from jaxrl.step.phases import advantages, completion_metrics, shape_rewards
from jaxrl.step.state import SkipCount
from tests.conftest import make_tiny_config

CONFIG = make_tiny_config("llama")
NUM_PROMPTS, PROMPT_LEN = 4, 5
SAMPLER = SamplerConfig(max_new_tokens=6, num_generations=4, end_token_ids=(1, 2, 3, 4, 5))
ROWS = NUM_PROMPTS * SAMPLER.num_generations
# eps well above fp32 roundoff of the gradients: Adam's first step, lr * g / (|g| + eps), is
# then smooth in g, so entries near 0 cannot flip sign between two summation orders.
OPTIM = OptimSection(lr=1e-2, eps=1e-3, max_grad_norm=1.0)
BASE = AlgoSection(loss=PolicyLossConfig(beta=0.0, tis_cap=2.0))


def _small_ids_reward(inputs):
    """Fraction of completion tokens with an id below a third of the vocabulary (in-graph)."""
    mask = inputs.completion_mask_BxC.astype(jnp.float32)
    small = (inputs.completion_ids_BxC < inputs.fields["threshold"][:, None]).astype(jnp.float32)
    return jnp.sum(small * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def _decode(ids, mask):
    return [" ".join(str(t) for t in row[m.astype(bool)]) for row, m in zip(ids, mask, strict=True)]


REWARDS = RewardSet(
    [JaxReward("small_ids", _small_ids_reward),
     PythonReward("even_len", lambda prompt, completion, fields: len(completion.split()) % 2,
                  weight=0.5)],
    decode=_decode)
# For the tests that are about the updates, not the rewards: without the Python reward's host
# callback their fused programs can be stored in XLA's persistent cache (tests/compile_stats.py).
JAX_REWARDS = RewardSet([JaxReward("small_ids", _small_ids_reward)], decode=_decode)


def _mesh(layout):
    devices = jax.devices()[:1] if layout == "single" else None
    return make_mesh(load_layout(layout), devices)


def _inputs(step):
    rng = np.random.default_rng(step)
    ids = rng.integers(6, CONFIG.vocab_size, (NUM_PROMPTS, PROMPT_LEN)).astype(np.int32)
    mask = np.arange(PROMPT_LEN)[None, :] >= np.array([0, 2, 1, 0])[:, None]
    prompts = Prompts(jnp.asarray(np.where(mask, ids, 0)), jnp.asarray(mask))
    fields = {"threshold": jnp.full((NUM_PROMPTS,), CONFIG.vocab_size // 3, jnp.int32)}
    rows = jnp.arange(NUM_PROMPTS, dtype=jnp.int32) + step * NUM_PROMPTS
    return prompts, fields, rows, jax.random.key(100 + step)


def _run(cfg: AlgoSection, layout: str = "single", steps: int = 1, rewards=REWARDS):
    """(params after each step as numpy, step counter, metrics of each step, Step, state)."""
    mesh = _mesh(layout)
    layout_ = load_layout(layout)
    adaptive = cfg.loss.entropy_coef if cfg.loss.entropy_target is not None else None
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM, mesh,
                            layout_.train_rules, adaptive_entropy_coef=adaptive)
    sharded = layout != "single"
    sampler = Sampler(nnx.graphdef(ts.model), SAMPLER, mesh=mesh if sharded else None,
                      rules=layout_.rollout_rules if sharded else None)
    graphdef, state = nnx.split(ts)
    step = build_step(cfg, graphdef, sampler, rewards, optim=OPTIM,
                      mesh=mesh if sharded else None,
                      rules=layout_.train_rules if sharded else None, phase_times=False)
    history, params = [], []
    for i in range(steps):
        state, out = step(state, i, _inputs)
        history.append(jax.device_get(out.metrics))
        params.append(_params(nnx.merge(graphdef, state)))
    return params, int(nnx.merge(graphdef, state).step), history, step, state


def _params(ts):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(ts.model, nnx.Param)))


@functools.cache
def _initial_params():
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                            _mesh("single"), load_layout("single").train_rules)
    return _params(ts)


@functools.cache
def _fused():
    return _run(BASE, steps=2)


def _assert_close(a, b, tol=2e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=tol, atol=tol), a, b)


def test_fused_step_updates_params_once_per_step_without_recompiling():
    params, count, history, step, _ = _fused()
    assert count == 2  # one update per step (1 iteration x 1 minibatch)
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), params[0], _initial_params())
    assert all(jax.tree.leaves(changed))
    (fused,) = step.programs
    assert fused._cache_size() == 1  # the second step reused the first one's program
    m = history[0]
    for name in ("reward/mean", "reward/std", "reward/small_ids", "reward/even_len",
                 "reward/errors", "completion/len_mean", "completion/clipped_frac",
                 "loss/policy", "loss/kl", "entropy", "clip_frac", "grad_norm", "lr",
                 "rollout/zero_std_frac", "rollout/num_steps", "tis/weight_mean"):
        assert np.isfinite(m[name]), name
    assert m["reward/errors"] == 0 and m["grad_norm"] > 0 and m["lr"] == pytest.approx(1e-2)
    assert m["rollout/num_steps"] >= 1 and m["rollout/num_steps"] <= SAMPLER.max_new_tokens
    # The dense sampler: every row goes through every decode step of the loop.
    assert m["rollout/decode_slot_steps"] == ROWS * (m["rollout/num_steps"] - 1)
    assert 0 < m["completion/len_mean"] <= SAMPLER.max_new_tokens
    # On-policy first update: the recomputed old log-probs give ratio 1, so nothing is clipped.
    assert m["clip_frac"] == 0


@pytest.mark.default_compiler  # bitwise: XLA's older CPU fusion emitters round otherwise
def test_fused_equals_split_bitwise():
    fused_params, fused_count, fused_history, *_ = _fused()
    split_params, split_count, split_history, step, _ = _run(
        dataclasses.replace(BASE, mode="split"), steps=2)
    assert len(step.programs) == 2 and split_count == fused_count == 2
    jax.tree.map(np.testing.assert_array_equal, split_params, fused_params)
    for f, s in zip(fused_history, split_history, strict=True):
        assert f.keys() == s.keys()
        jax.tree.map(np.testing.assert_array_equal, s, f)


def test_grad_accumulation_equals_full_batch():
    full = _fused()
    accumulated = _run(dataclasses.replace(BASE, microbatch_size=ROWS // 2))
    assert accumulated[1] == 1
    _assert_close(accumulated[0][0], full[0][0])
    for name in ("loss/policy", "entropy", "grad_norm", "clip_frac"):
        np.testing.assert_allclose(accumulated[2][0][name], full[2][0][name], rtol=1e-5,
                                   atol=1e-6)


def test_iterations_and_minibatches_count_updates():
    cfg = dataclasses.replace(BASE, num_iterations=2, num_minibatches=2, microbatch_size=4,
                              loss=PolicyLossConfig(beta=0.05), mask_zero_std_groups=True,
                              advantage="rloo")
    mesh = _mesh("single")
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM, mesh,
                            load_layout("single").train_rules)
    ref = reference_params(ts)
    graphdef, state = nnx.split(ts)
    step = build_step(cfg, graphdef, Sampler(nnx.graphdef(ts.model), SAMPLER), REWARDS,
                      optim=OPTIM, phase_times=False)
    state, out = step(state, 0, _inputs, ref_params=ref)
    assert int(nnx.merge(graphdef, state).step) == 4
    # After the first update the policy moved away from the reference: KL > 0.
    assert float(out.metrics["loss/kl"]) > 0


def test_sharded_step_matches_single_device():
    params, count, history, _, state = _run(BASE, layout="dp_fsdp_tp", steps=1)
    assert count == 1
    _assert_close(params[0], _fused()[0][0])
    # The donated state keeps its layout: parameters stay split over fsdp and tensor.
    specs = [x.sharding.spec for x in jax.tree.leaves(state) if x.ndim == 2]
    assert any("fsdp" in s and "tensor" in s for s in specs)


def test_advantages_mask_zero_std_groups_and_completion_metrics_by_hand():
    rewards_B = jnp.array([1.0, 1.0, 0.0, 1.0])  # group 0 has no signal, group 1 has
    mask_BxC = jnp.ones((4, 3), bool)
    cfg = AlgoSection(advantage="dr_grpo", mask_zero_std_groups=True)
    adv_B, loss_mask_BxC, metrics = advantages(cfg, rewards_B, mask_BxC, 2)
    np.testing.assert_array_equal(adv_B, [0.0, 0.0, -0.5, 0.5])
    np.testing.assert_array_equal(loss_mask_BxC.sum(axis=1), [0, 0, 3, 3])
    assert metrics["rollout/zero_std_frac"] == 0.5

    ids = jnp.array([[7, 1, 0], [7, 8, 9], [7, 8, 1], [5, 0, 0]])  # 1 = stop
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], bool)
    zeros = jnp.zeros((4, 3))
    rollout = Rollout(ids[:, :1], mask[:, :1], ids, mask, zeros, zeros, jnp.int32(3),
                      jnp.int32(8))
    m = completion_metrics(rollout, (1,))
    # Row 1 filled the budget without a stop token; row 2 stopped on the last column.
    assert m["completion/clipped_frac"] == 0.25
    assert m["completion/len_mean"] == 2.25 and m["rollout/num_steps"] == 3
    assert m["rollout/decode_slot_steps"] == 8


def test_chunked_log_probs_give_the_same_step():
    # 40 columns per chunk: the 96-token vocabulary is 3 chunks, the last one padded.
    chunked = _run(dataclasses.replace(BASE, logprob_chunk_size=40))
    full = _fused()
    _assert_close(chunked[0][0], full[0][0])
    for name in ("loss/policy", "entropy", "grad_norm", "tis/weight_mean"):
        np.testing.assert_allclose(chunked[2][0][name], full[2][0][name], rtol=1e-5, atol=1e-6)


def test_a_prompt_shared_by_its_group_gives_the_same_step():
    # Two iterations: the old log-probs' forward and both updates run with the prompts shared
    # (one microbatch of 16 rows: each prompt once for its 4 rows) and without.
    cfg = dataclasses.replace(BASE, num_iterations=2)
    assert prompt_group(cfg, CONFIG, SAMPLER.num_generations, ROWS, 1) == 4
    shared = _run(cfg)
    whole = _run(dataclasses.replace(cfg, share_prompts=False))
    assert shared[1] == whole[1] == 2
    _assert_close(shared[0][0], whole[0][0])
    for name in ("loss/policy", "entropy", "grad_norm", "clip_frac", "tis/weight_mean"):
        np.testing.assert_allclose(shared[2][0][name], whole[2][0][name], rtol=1e-5, atol=1e-6)


def test_overlong_shaping_by_hand():
    rewards_B = jnp.array([1.0, 1.0, 0.5, 0.0])
    # Lengths 2, 3, 4, 4 of a budget of 4 with a soft zone of the last 2 tokens:
    # penalties 0 (at the zone's start), -1/2, -1 (truncated), -1.
    mask_BxC = jnp.arange(4)[None, :] < jnp.array([2, 3, 4, 4])[:, None]
    shaped_B, metrics = shape_rewards(AlgoSection(overlong_buffer=2), rewards_B, mask_BxC)
    np.testing.assert_allclose(shaped_B, [1.0, 0.5, -0.5, -1.0])
    assert metrics["reward/overlong"] == pytest.approx(-0.625)
    unshaped_B, metrics = shape_rewards(AlgoSection(), rewards_B, mask_BxC)
    np.testing.assert_array_equal(unshaped_B, rewards_B)
    assert metrics == {}


def test_a_single_update_step_takes_its_old_log_probs_from_its_own_forward():
    # One update per step: old_logp = stop_gradient(new logp) of the loss's own forward gives
    # the same update as a separate forward pass of the (same) old policy.
    from jaxrl.step.forward import completion_log_probs
    from jaxrl.step.updates import apply_updates

    cfg = AlgoSection(microbatch_size=4, loss=PolicyLossConfig(beta=0.0))
    assert cfg.single_update and not dataclasses.replace(cfg, num_minibatches=2).single_update
    rng = np.random.default_rng(0)
    rows, prompt, completion = 8, 5, 6
    batch = {
        "ids_BxT": jnp.asarray(rng.integers(0, CONFIG.vocab_size, (rows, prompt + completion)),
                               jnp.int32),
        "mask_BxT": jnp.ones((rows, prompt + completion), bool),
        "loss_mask_BxC": jnp.asarray(rng.random((rows, completion)) < 0.8),
        "adv_B": jnp.asarray(rng.normal(size=rows), jnp.float32),
        "sampler_logp_BxC": jnp.zeros((rows, completion), jnp.float32),
    }

    def updated(batch):
        ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                                _mesh("single"), load_layout("single").train_rules)
        metrics = apply_updates(cfg, ts, batch, 1.0)
        return _params(ts), jax.device_get(metrics)

    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                            _mesh("single"), load_layout("single").train_rules)
    old_logp = completion_log_probs(ts.model, batch, 1.0)[0]
    own, own_metrics = updated(batch)
    separate, separate_metrics = updated(dict(batch, old_logp_BxC=old_logp))
    _assert_close(own, separate, tol=1e-6)
    assert own_metrics["clip_frac"] == separate_metrics["clip_frac"] == 0.0
    np.testing.assert_allclose(own_metrics["loss/policy"], separate_metrics["loss/policy"],
                               rtol=1e-5, atol=1e-7)


def test_a_decaying_entropy_bonus_equals_steps_with_each_coefficient():
    # entropy_coef 0.5, decaying over 2 steps from step 1: 0.5, 0.5, 0.25, then 0. With 2
    # updates per step, the schedule reads the RL step from the update count.
    def algo(coef, **decay):
        return dataclasses.replace(BASE, num_minibatches=2, **decay,
                                   loss=PolicyLossConfig(tis_cap=2.0, entropy_coef=coef))

    params, count, history, *_ = _run(
        algo(0.5, entropy_decay_start=1, entropy_decay_steps=2), steps=4, rewards=JAX_REWARDS)
    assert count == 8
    assert [float(m["entropy_coef"]) for m in history] == [0.5, 0.5, 0.25, 0.0]
    # The same four steps, each built with its constant coefficient, give the same policy.
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                            _mesh("single"), load_layout("single").train_rules)
    graphdef, state = nnx.split(ts)
    steps = {coef: build_step(algo(coef), graphdef, Sampler(nnx.graphdef(ts.model), SAMPLER),
                              JAX_REWARDS, optim=OPTIM, phase_times=False)
             for coef in (0.5, 0.25, 0.0)}  # 3 compiles
    for i, coef in enumerate((0.5, 0.5, 0.25, 0.0)):
        state, _ = steps[coef](state, i, _inputs)
    _assert_close(_params(nnx.merge(graphdef, state)), params[-1])


def test_the_adaptive_entropy_coefficient_is_kept_with_the_optimizer():
    # Entropy always below the target 100: from 0.1 the coefficient rises by 0.05 an update,
    # to at most 0.22; two updates a step, the metric is their mean; the state keeps the
    # coefficient and the last update's entropy.
    cfg = dataclasses.replace(BASE, num_minibatches=2, loss=PolicyLossConfig(
        tis_cap=2.0, entropy_coef=0.1, entropy_target=100.0, entropy_coef_delta=0.05,
        entropy_coef_max=0.22))
    _, count, history, _, state = _run(cfg, steps=2, rewards=JAX_REWARDS)
    assert count == 4
    np.testing.assert_allclose([m["entropy_coef"] for m in history], [0.175, 0.22], rtol=1e-6)
    kept = state["optimizer"]
    np.testing.assert_allclose(kept["entropy_coef"][...], 0.22, rtol=1e-6)
    np.testing.assert_allclose(kept["last_entropy"][...], history[-1]["entropy"], rtol=0.5)


@pytest.mark.parametrize("minibatches", [1, 2])  # a conditional; a select inside the loop
def test_a_non_finite_update_leaves_every_parameter_moment_and_count_as_it_was(monkeypatch,
                                                                               minibatches):
    from jaxrl.step import updates

    policy_loss = updates.policy_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        return loss * jnp.nan, metrics

    monkeypatch.setattr(updates, "policy_loss", nan_loss)
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                            _mesh("single"), load_layout("single").train_rules)
    graphdef, state = nnx.split(ts)
    before = jax.tree.map(np.array, state)
    step = build_step(dataclasses.replace(BASE, num_minibatches=minibatches), graphdef,
                      Sampler(nnx.graphdef(ts.model), SAMPLER), JAX_REWARDS, optim=OPTIM,
                      phase_times=False)
    state, out = step(state, 0, _inputs)
    assert int(out.metrics["train/skipped_updates"]) == minibatches
    assert int(out.metrics["train/skipped_in_a_row"]) == 1
    after = nnx.merge(graphdef, state)
    assert int(after.step) == 0
    # Params, both Adam moments and the counts, bit for bit (the skip counters moved).
    kept = jax.tree.map(np.asarray, nnx.state(after, nnx.Not(SkipCount)))
    want = nnx.state(nnx.merge(graphdef, before), nnx.Not(SkipCount))
    assert len(jax.tree.leaves(want)) > 2 * len(jax.tree.leaves(_initial_params()))
    jax.tree.map(np.testing.assert_array_equal, kept, jax.tree.map(np.asarray, want))
