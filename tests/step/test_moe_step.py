"""The RL step with a mixture-of-experts policy: the load-balancing term of the loss by hand,
its statistics with a shared prompt, and expert parallelism (fsdp_ep) ≡ one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import AlgoSection
from jaxrl.models import Transformer
from jaxrl.models.moe import load_balancing_loss
from jaxrl.rl import PolicyLossConfig
from jaxrl.rollout import Sampler
from jaxrl.sharding import load_layout
from jaxrl.step import create_train_state
from jaxrl.step.builder import build_step
from jaxrl.step.updates import microbatch_loss
from tests.conftest import make_tiny_config
from tests.step.test_builder import OPTIM, REWARDS, SAMPLER, _assert_close, _inputs, _mesh, _params

MOE = make_tiny_config("qwen3_moe", vocab_size=make_tiny_config("llama").vocab_size)
AUX = AlgoSection(loss=PolicyLossConfig(beta=0.0), router_aux_coef=0.05)


def _batch(rows=4, p=5, c=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, MOE.vocab_size, (rows, p + c)).astype(np.int32)
    mask = np.ones((rows, p + c), bool)
    mask[1, :2] = mask[3, :1] = False  # left padding
    mask[2, -1] = False  # a completion that stopped early
    return {"ids_BxT": jnp.asarray(ids), "mask_BxT": jnp.asarray(mask),
            "loss_mask_BxC": jnp.asarray(mask[:, p:]),
            "adv_B": jnp.asarray(rng.normal(size=rows), jnp.float32)}


def test_router_aux_term_is_the_coefficient_times_the_load_balancing_loss():
    graphdef, state = nnx.split(Transformer(MOE, rngs=nnx.Rngs(0)))
    mb = _batch()
    num_tokens = jnp.sum(mb["loss_mask_BxC"])
    off = dataclasses.replace(AUX, router_aux_coef=0.0)

    def loss_fn(cfg):
        return jax.jit(lambda state, mb: microbatch_loss(
            cfg, nnx.merge(graphdef, state), mb, num_tokens, jnp.int32(4), 1.0))

    loss0, metrics0 = loss_fn(off)(state, mb)
    loss, metrics = loss_fn(AUX)(state, mb)
    _, stats = jax.jit(lambda state: nnx.merge(graphdef, state).hidden_states(
        mb["ids_BxT"], mb["mask_BxT"], router_stats=True))(state)
    aux = load_balancing_loss(stats, MOE.num_layers, jnp.sum(mb["mask_BxT"]))
    assert "loss/router_aux" not in metrics0
    assert float(metrics["loss/router_aux"]) == pytest.approx(float(aux), rel=1e-6)
    assert float(aux) > 1.0  # about k = 2 for a balanced router (0: the term is missing)
    assert float(loss - loss0) == pytest.approx(0.05 * float(aux), rel=1e-4)

    # The router's gradient gets the aux term's: zero advantages leave only it.
    mb["adv_B"] = jnp.zeros_like(mb["adv_B"])

    def router_grad(cfg):
        grads = jax.jit(jax.grad(lambda state: loss_fn(cfg)(state, mb)[0]))(state)
        return np.asarray(grads["layers"][0]["mlp"]["router"][...])

    assert np.abs(router_grad(off)).max() == 0
    assert np.abs(router_grad(AUX)).max() > 0


@pytest.mark.parametrize("scan_layers", [False, True])
def test_router_stats_of_a_shared_prompt_count_it_for_each_row(scan_layers):
    model = Transformer(dataclasses.replace(MOE, scan_layers=scan_layers), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    n, g, p, c = 2, 3, 4, 3
    prompt = rng.integers(1, MOE.vocab_size, (n, p)).astype(np.int32)
    prompt_mask = np.array([[True] * p, [False] + [True] * (p - 1)])
    ids = rng.integers(1, MOE.vocab_size, (n * g, c)).astype(np.int32)
    mask = np.ones((n * g, c), bool)
    mask[4, -1] = False
    *_, shared = model.hidden_states_shared_prompt(prompt, prompt_mask, ids, mask,
                                                   router_stats=True)
    rows = np.concatenate([np.repeat(prompt, g, 0), ids], 1)
    rows_mask = np.concatenate([np.repeat(prompt_mask, g, 0), mask], 1)
    _, full = model.hidden_states(jnp.asarray(rows), jnp.asarray(rows_mask), router_stats=True)
    np.testing.assert_allclose(np.asarray(shared), np.asarray(full), rtol=1e-5, atol=1e-5)
    assert float(full[0].sum()) == MOE.num_layers * MOE.num_experts_per_tok * rows_mask.sum()


def _run(layout):
    mesh = _mesh(layout)
    lay = load_layout(layout)
    ts = create_train_state(lambda: Transformer(MOE, rngs=nnx.Rngs(0)), OPTIM, mesh,
                            lay.train_rules)
    sharded = layout != "single"
    sampler = Sampler(nnx.graphdef(ts.model), SAMPLER, mesh=mesh if sharded else None,
                      rules=lay.rollout_rules if sharded else None)
    graphdef, state = nnx.split(ts)
    step = build_step(AUX, graphdef, sampler, REWARDS, optim=OPTIM,
                      mesh=mesh if sharded else None, rules=lay.train_rules if sharded else None,
                      phase_times=False)
    state, out = step(state, 0, _inputs)
    return _params(nnx.merge(graphdef, state)), jax.device_get(out.metrics), state


def test_expert_parallel_step_matches_single_device():
    single, single_metrics, _ = _run("single")
    ep, ep_metrics, state = _run("fsdp_ep")
    _assert_close(ep, single)
    assert ep_metrics["loss/router_aux"] == pytest.approx(single_metrics["loss/router_aux"],
                                                          rel=1e-5)
    assert single_metrics["loss/router_aux"] > 1.0
    # The experts stay split by expert over fsdp in the donated state.
    layer = nnx.merge(nnx.graphdef(state), state).model.layers[0]
    assert layer.mlp.gate_up.get_value().sharding.spec[0] == "fsdp"
