"""Packed training (`jaxrl.step.packing`): the same numbers as the padded rows.

The plan places every real token once, in order, rows never straddling; a packed forward gives
each sequence the hidden states of its own padded row and never attends across a segment;
and `apply_updates` with `algo.packing` on equals it off (loss, grad norm, every metric and the
updated parameters) for every aggregation, KL on and off, GSPO and LUSPO sequence ratios,
several updates (the old-log-prob forward packed), multi-turn observation masks, GAE with a
value head and with a separate critic, LoRA and an MoE's router loss. Every case checks that
its microbatches did run packed (train/packed_frac), so a path that fell back to padding
could not pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.config.critic import CriticSection
from jaxrl.models import Transformer
from jaxrl.models.lora_config import LORA_MODULES, LoraConfig
from jaxrl.perf.flops import PhaseCount, ProgramCost, StepFlops
from jaxrl.rl import JaxReward, PolicyLossConfig, RewardSet
from jaxrl.rollout import Prompts, Sampler, SamplerConfig
from jaxrl.sharding import load_layout, make_mesh, use_rules
from jaxrl.step import build_step, create_train_state, packing, reference_params
from jaxrl.step.critic import gae_batch
from jaxrl.step.updates import apply_updates
from tests.conftest import make_tiny_config

LLAMA = make_tiny_config("llama")
OPTIM = OptimSection(lr=1e-2, eps=1e-3, max_grad_norm=1.0)
ROWS, P, C = 8, 4, 32


def _masks(rng, rows=ROWS, p=P, c=C, fixed=False):
    """Left-padded prompts and long-tailed completions (two rows at the cap)."""
    prompt_len = rng.integers(1, p + 1, rows)
    completion_len = np.full(rows, c) if fixed else np.minimum(rng.geometric(0.2, rows), c)
    completion_len[:2] = c
    prompt = np.arange(p)[None] >= (p - prompt_len)[:, None]
    completion = np.arange(c)[None] < completion_len[:, None]
    return np.concatenate([prompt, completion], 1), completion


def _batch(seed=0, vocab=LLAMA.vocab_size, observations=False, fixed=False, rows=ROWS):
    rng = np.random.default_rng(seed)
    mask, completion = _masks(rng, rows=rows, fixed=fixed)
    loss_mask = completion.copy()
    if observations:  # a tool's answer in the middle of each completion: real, not trained
        loss_mask[:, 3:6] = False
    return {"ids_BxT": jnp.asarray(rng.integers(0, vocab, mask.shape), jnp.int32),
            "mask_BxT": jnp.asarray(mask), "loss_mask_BxC": jnp.asarray(loss_mask),
            "adv_B": jnp.asarray(rng.normal(size=rows), jnp.float32),
            "sampler_logp_BxC": jnp.asarray(-rng.uniform(0.5, 3.0, completion.shape),
                                            jnp.float32)}


# ----------------------------------------------------------------------------- the plan


def test_the_plan_places_every_real_token_once_in_order_and_no_row_straddles():
    rng = np.random.default_rng(3)
    mask, _ = _masks(rng)
    plan = packing.plan_rows(jnp.asarray(mask), C)
    t = mask.shape[1]
    dest = np.asarray(plan.dest_BxT)
    real = dest[mask]
    assert len(set(real.tolist())) == mask.sum()  # no two tokens share a place
    assert np.all(dest[~mask] == ROWS * t)  # padding goes nowhere
    for b in range(ROWS):
        d = dest[b][mask[b]]
        assert np.all(np.diff(d) == 1)  # consecutive, in order
        assert d[0] // t == d[-1] // t  # one packed row
    used = int(plan.rows_used)
    assert used == len({int(x) // t for x in real}) and used < ROWS
    # The position predicting completion token c is the real token just before it.
    predictor = np.asarray(plan.predictor_BxC)
    for b in range(ROWS):
        for c in range(int(mask[b, P:].sum())):
            assert predictor[b, c] == dest[b, P - 1 + c]


def test_budgets_keep_only_packed_shapes_cheaper_than_the_padded_rows():
    assert packing.budgets(64, 288, 256) == (16, 32, 48)
    assert packing.budgets(64, 288, 256, shards=3) == (18, 33, 48)
    # Prompts shared by 8 rows: 96-wide rows of 64 completion tokens pay only below 45 rows.
    assert packing.budgets(64, 96, 64, prompt_group=8) == (16, 32)
    assert packing.budgets(64, 40, 8) == ()  # short completions never pack
    assert packing.budgets(2, 33, 32) == (1,)


def test_branch_is_the_smallest_budget_that_holds_the_rows_else_padded():
    fixed, _ = _masks(np.random.default_rng(0), fixed=True)
    plan = packing.plan_rows(jnp.asarray(fixed), C)
    assert int(plan.rows_used) == ROWS  # every row fills a packed row
    assert int(packing.branch(plan, (2, 4, 6))) == 3
    ragged, _ = _masks(np.random.default_rng(0))
    plan = packing.plan_rows(jnp.asarray(ragged), C)
    want = next(i for i, r in enumerate((2, 4, 6)) if int(plan.rows_used) <= r)
    assert int(packing.branch(plan, (2, 4, 6))) == want


# ----------------------------------------------------------------------------- the forward


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 4
def test_a_packed_sequence_gets_its_own_rows_hidden_states_and_sees_no_other(family):
    config = make_tiny_config(family)
    model = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    mask, _ = _masks(rng, c=10, p=4, rows=5)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, mask.shape), jnp.int32)
    mask = jnp.asarray(mask)
    want = model.hidden_states(ids, mask)
    plan = packing.plan_rows(mask, 10)
    rows = int(plan.rows_used)
    assert rows < 5  # several sequences share a packed row
    packed_ids, positions, segments, _ = packing.packed_inputs(ids, mask, plan, rows)
    got = model.hidden_states_packed(packed_ids, positions, segments)
    flat = got.reshape(-1, got.shape[-1])
    dest = np.asarray(plan.dest_BxT)
    np.testing.assert_allclose(flat[dest[np.asarray(mask)]], want[np.asarray(mask)],
                               rtol=1e-5, atol=1e-5)
    # Another sequence's tokens change nothing of this one's (attention stays in its segment).
    other = jnp.where(segments == segments[0, 0], packed_ids, (packed_ids + 7) % config.vocab_size)
    changed = model.hidden_states_packed(other, positions, segments)
    first = np.asarray(segments == segments[0, 0])
    np.testing.assert_array_equal(np.asarray(changed)[first], np.asarray(got)[first])
    assert not np.allclose(np.asarray(changed)[~first & (np.asarray(segments) > 0)],
                           np.asarray(got)[~first & (np.asarray(segments) > 0)])


# ----------------------------------------------------------------------------- the step


def _train(cfg: AlgoSection, config=LLAMA, *, observations=False, fixed=False, rows=ROWS,
           layout="single"):
    """(metrics, updated params) of `apply_updates` on a long-tailed batch, one jitted program
    (on `layout`'s mesh over every device, its train rules active)."""
    lay = load_layout(layout)
    mesh = make_mesh(lay, jax.devices()[:1] if layout == "single" else None)
    critic = cfg.critic if cfg.advantage == "gae" else None
    ts = create_train_state(lambda: Transformer(config, rngs=nnx.Rngs(0, lora=3)), OPTIM, mesh,
                            lay.train_rules, critic=critic)
    ref = reference_params(ts) if cfg.loss.beta > 0 and config.lora is None else None
    graphdef, state = nnx.split(ts)
    batch = _batch(vocab=config.vocab_size, observations=observations, fixed=fixed, rows=rows)

    @jax.jit
    def step(state, batch):
        with use_rules(mesh, lay.train_rules):
            ts = nnx.merge(graphdef, state)
            b, extra = batch, {}
            if cfg.advantage == "gae":
                b, extra = gae_batch(cfg, ts, batch)
            metrics = apply_updates(cfg, ts, b, 1.0, ref_params=ref)
            return metrics | extra, nnx.state(ts, nnx.Param)

    metrics, params = step(state, batch)
    return jax.device_get(metrics), jax.device_get(params)


def _assert_same(cfg: AlgoSection, config=LLAMA, packed_frac=1.0, **kw):
    """`apply_updates` packed ≡ padded; `packed_frac`: the microbatches expected to pack."""
    padded, padded_params = _train(dataclasses.replace(cfg, packing=False), config, **kw)
    packed, packed_params = _train(cfg, config, **kw)
    assert packed["train/packed_frac"] == packed_frac
    assert "train/packed_frac" not in padded
    for name in ("loss/policy", "grad_norm"):
        assert abs(packed[name]) > 1e-6, name  # a real loss and gradient, not zeros
    for name, value in padded.items():
        np.testing.assert_allclose(packed[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 packed_params, padded_params)
    return packed


LOSS = PolicyLossConfig(beta=0.0, tis_cap=2.0)
CASES = {
    # several updates: the old log-probs' forward runs packed too; KL on (k3 against the start)
    "token_mean_kl_minibatches": AlgoSection(
        num_minibatches=2, microbatch_size=2, loss=dataclasses.replace(LOSS, beta=0.05)),
    "seq_mean_token_mean": AlgoSection(loss=dataclasses.replace(
        LOSS, aggregation="seq_mean_token_mean")),
    "dr_grpo_kl_k2": AlgoSection(num_iterations=2, loss=dataclasses.replace(
        LOSS, aggregation="seq_mean_token_sum_norm", beta=0.1, kl_estimator="k2")),
    "gspo": AlgoSection(num_minibatches=2, loss=dataclasses.replace(
        LOSS, importance_level="sequence", aggregation="seq_mean_token_mean",
        epsilon_low=3e-4, epsilon_high=4e-4)),
    "luspo": AlgoSection(num_minibatches=2, loss=dataclasses.replace(
        LOSS, importance_level="sequence", aggregation="seq_mean_token_sum")),
    "top_entropy_bonus": AlgoSection(microbatch_size=4, loss=dataclasses.replace(
        LOSS, entropy_coef=0.01, entropy_aggregation="tokens", top_entropy_quantile=0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_training_equals_padded(case):
    # Microbatches of 2 strided rows: the two at the cap (rows 0 and 1) each share theirs
    # with a short row, which does not fit beside them: those two microbatches run padded.
    cfg = CASES[case]
    _assert_same(cfg, packed_frac=0.5 if cfg.microbatch_size == 2 else 1.0)


def test_packed_training_equals_padded_with_multi_turn_observation_masks():
    _assert_same(AlgoSection(loss=LOSS), observations=True)


@pytest.mark.parametrize("kind", ["value_head", "separate"])
def test_packed_ppo_with_a_critic_equals_padded(kind):
    cfg = AlgoSection(advantage="gae", num_minibatches=2, loss=LOSS,
                      critic=CriticSection(kind=kind))
    metrics = _assert_same(cfg)
    assert abs(metrics["value/loss"]) > 0


def test_packed_lora_with_its_base_as_kl_reference_equals_padded():
    config = dataclasses.replace(LLAMA, lora=LoraConfig(4, 8.0, tuple(LORA_MODULES)))
    _assert_same(AlgoSection(num_minibatches=2, loss=dataclasses.replace(LOSS, beta=0.05)),
                 config)


def test_packed_moe_router_loss_equals_padded():
    moe = make_tiny_config("qwen3_moe", vocab_size=LLAMA.vocab_size)
    metrics = _assert_same(AlgoSection(router_aux_coef=0.01, loss=LOSS), moe)
    assert metrics["loss/router_aux"] > 0


def test_packed_training_on_a_sharded_mesh_equals_padded_on_one_device():
    # (2, 2, 2) over 8 devices: 16 rows split over 4 batch shards pack into 4, 8 or 12 rows.
    cfg = AlgoSection(loss=dataclasses.replace(LOSS, beta=0.05))
    padded, padded_params = _train(dataclasses.replace(cfg, packing=False), rows=16)
    packed, packed_params = _train(cfg, rows=16, layout="dp_fsdp_tp")
    assert packed["train/packed_frac"] == 1.0 and packed["train/run_row_frac"] < 1.0
    for name, value in padded.items():
        np.testing.assert_allclose(packed[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 packed_params, padded_params)


def test_equal_lengths_run_padded_and_count_every_token():
    metrics = _assert_same(AlgoSection(loss=LOSS), fixed=True, packed_frac=0.0)
    assert metrics["train/run_row_frac"] == 1.0


def test_a_packed_steps_train_flops_follow_its_tokens():
    def phase(name, flops, trips=1):
        return PhaseCount(ProgramCost(name, flops, None, ""), trips)

    flops = StepFlops(generate=(phase("prefill", 5.0),),
                      train=(phase("grad", 100.0, 2), phase("update", 10.0)))
    assert flops.train_flops() == 210.0
    assert flops.train_flops(0.25) == 60.0  # the optimizer update does not shrink
    assert flops.total(0, 0.25) == 65.0


def _small_ids(inputs):
    """Fraction of completion tokens with an id below half the vocabulary."""
    mask = inputs.completion_mask_BxC.astype(jnp.float32)
    small = (inputs.completion_ids_BxC < LLAMA.vocab_size // 2).astype(jnp.float32)
    return jnp.sum(small * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)


def _step(cfg: AlgoSection):
    """Metrics and params after one fused or split step that generates its own rows: 4
    prompts x 4 samples of at most 32 tokens, ended early by any of 5 stop ids."""
    mesh = make_mesh(load_layout("single"), jax.devices()[:1])
    ts = create_train_state(lambda: Transformer(LLAMA, rngs=nnx.Rngs(0)), OPTIM, mesh,
                            load_layout("single").train_rules)
    sampler = Sampler(nnx.graphdef(ts.model), SamplerConfig(
        max_new_tokens=C, num_generations=4, end_token_ids=(1, 2, 3, 4, 5)))
    rewards = RewardSet([JaxReward("small_ids", _small_ids)], decode=None)
    graphdef, state = nnx.split(ts)
    step = build_step(cfg, graphdef, sampler, rewards, optim=OPTIM, phase_times=False)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(6, LLAMA.vocab_size, (4, P)), jnp.int32)
    prompts = Prompts(ids, jnp.ones((4, P), bool))
    state, out = step(state, 0, lambda n: (prompts, {}, jnp.arange(4, dtype=jnp.int32),
                                           jax.random.key(7)))
    return jax.device_get(out.metrics), jax.device_get(nnx.state(nnx.merge(graphdef, state).model,
                                                                 nnx.Param))


def test_fused_and_split_steps_pack_what_they_generate_with_the_padded_numbers():
    cfg = AlgoSection(num_minibatches=2, loss=dataclasses.replace(LOSS, beta=0.0))
    padded, padded_params = _step(dataclasses.replace(cfg, packing=False))
    fused, fused_params = _step(cfg)
    split, split_params = _step(dataclasses.replace(cfg, mode="split"))
    assert fused["train/packed_frac"] > 0 and fused["train/real_token_frac"] < 0.8
    for name, value in padded.items():
        if name.startswith(("time/", "perf/")):
            continue
        np.testing.assert_allclose(fused[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_array_equal(split[name], fused[name], err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 fused_params, padded_params)
    jax.tree.map(np.testing.assert_array_equal, split_params, fused_params)
