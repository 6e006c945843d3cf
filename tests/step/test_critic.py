"""PPO with a learned critic in the step (algo.advantage gae): the warm-up updates the critic
alone, then both critic kinds train with the policy, a separate critic starts as a copy of
the policy but is its own, fused ≡ split; on test_builder's tiny policy, prompts and
rewards."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import AlgoSection
from jaxrl.config.critic import CriticSection
from jaxrl.models import Transformer
from jaxrl.rollout import Sampler
from jaxrl.sharding import load_layout
from jaxrl.step import create_train_state
from jaxrl.step.builder import build_step
from tests.step.test_builder import CONFIG, OPTIM, REWARDS, SAMPLER, _inputs, _mesh

# Two minibatches (two updates a step: the old log-probs forward runs too) of two
# microbatches each (accumulation with the value loss's whole-minibatch counts).
PPO = AlgoSection(advantage="gae", num_minibatches=2, microbatch_size=4)


def _pure(module):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module, nnx.Param)))


def _run(cfg: AlgoSection, steps: int = 2, params_after=None):
    """(initial (policy, critic) params, TrainState after `steps` steps, metrics per step);
    `params_after`: a list that gets (policy, critic, policy updates) after each step."""
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                            _mesh("single"), load_layout("single").train_rules,
                            critic=cfg.critic)
    initial = (_pure(ts.model), _pure(ts.critic))
    sampler = Sampler(nnx.graphdef(ts.model), SAMPLER)
    graphdef, state = nnx.split(ts)
    step = build_step(cfg, graphdef, sampler, REWARDS, optim=OPTIM, phase_times=False)
    history = []
    for i in range(steps):
        state, out = step(state, i, _inputs)
        history.append(jax.device_get(out.metrics))
        if params_after is not None:
            ts = nnx.merge(graphdef, state)
            params_after.append((_pure(ts.model), _pure(ts.critic), int(ts.step)))
    assert sum(p._cache_size() for p in step.programs) == len(step.programs)  # no recompile
    return initial, nnx.merge(graphdef, state), history


@functools.cache
def _fused(kind: str, mode: str = "fused"):
    """Two steps, the first of them the critic's warm-up."""
    after = []
    cfg = dataclasses.replace(PPO, mode=mode, critic=CriticSection(kind=kind, warmup_steps=1))
    return (*_run(cfg, params_after=after), after)


def _changed(a, b):
    return jax.tree.leaves(jax.tree.map(lambda x, y: not np.array_equal(x, y), a, b))


@pytest.mark.parametrize("kind", ["separate", "value_head"])
def test_the_critic_warms_up_alone_then_both_train(kind):
    (policy0, critic0), ts, history, after = _fused(kind)
    (policy1, critic1, updates1), (policy2, _, updates2) = after
    # Step 0 (warm-up): only the critic's 2 updates; the policy (a value head's trunk
    # included) is untouched and its optimizer has counted nothing.
    jax.tree.map(np.testing.assert_array_equal, policy1, policy0)
    assert updates1 == 0 and any(_changed(critic1, critic0))
    # Step 1: both. The policy's optimizer counted only step 1's updates, so its schedule
    # starts after the warm-up.
    assert updates2 == 2 and int(ts.critic_optimizer.step[...]) == 4
    assert all(_changed(policy2, policy0))
    for m in history:
        for name in ("value/loss", "value/explained_variance", "value/mean", "value/clip_frac",
                     "value/returns_mean", "value/grad_norm", "loss/policy", "grad_norm"):
            assert np.isfinite(m[name]), (kind, name)
        assert m["value/loss"] > 0 and m["value/grad_norm"] > 0
    # The head starts at 0, so the first step's values are all 0 and explain nothing; the
    # second step's come from a critic trained one step.
    assert history[0]["value/mean"] == 0 and history[0]["value/explained_variance"] == 0
    assert history[1]["value/mean"] != 0
    if kind == "separate":
        # Its trunk started as the policy's weights and then trained on its own.
        jax.tree.map(np.testing.assert_array_equal, critic0["trunk"], policy0)
        assert all(_changed(_pure(ts.critic.trunk), _pure(ts.model)))
    else:
        assert ts.critic.trunk is None and set(critic0) == {"head"}


def test_fused_equals_split_bitwise_with_a_critic():
    _, fused, fused_history, _ = _fused("separate")
    _, split, split_history, _ = _fused("separate", "split")
    jax.tree.map(np.testing.assert_array_equal, _pure(split), _pure(fused))
    for f, s in zip(fused_history, split_history, strict=True):
        assert f.keys() == s.keys()
        jax.tree.map(np.testing.assert_array_equal, s, f)


def test_a_lora_policy_trains_its_adapters_beside_a_separate_critic():
    """LoRA + a separate critic: the policy's gradient is its adapters' only and the
    critic's every parameter (one filter each: nnx's paths inside the (policy, critic) tuple
    do not name the tuple's index, so one filter over both once took every policy parameter
    and failed to match the adapters' optimizer)."""
    from jaxrl.models.lora_config import LORA_MODULES, LoraConfig

    config = dataclasses.replace(CONFIG, lora=LoraConfig(4, 8.0, LORA_MODULES))
    cfg = dataclasses.replace(PPO, critic=CriticSection(kind="separate", warmup_steps=1))
    ts = create_train_state(lambda: Transformer(config, rngs=nnx.Rngs(0, lora=1)), OPTIM,
                            _mesh("single"), load_layout("single").train_rules,
                            critic=cfg.critic)

    def parts(ts):
        base = nnx.to_pure_dict(nnx.state(ts.model, nnx.Not(nnx.LoRAParam)))
        adapters = nnx.to_pure_dict(nnx.state(ts.model, nnx.LoRAParam))
        critic = nnx.to_pure_dict(nnx.state(ts.critic, nnx.Param))
        return jax.tree.map(np.asarray, (base, adapters, critic))

    before = parts(ts)
    graphdef, state = nnx.split(ts)
    step = build_step(cfg, graphdef, Sampler(nnx.graphdef(ts.model), SAMPLER), REWARDS,
                      optim=OPTIM, phase_times=False)
    for i in range(2):  # the critic's warm-up, then both
        state, out = step(state, i, _inputs)
        assert np.isfinite(jax.device_get(out.metrics)["grad_norm"])
    base, adapters, critic = parts(nnx.merge(graphdef, state))
    jax.tree.map(np.testing.assert_array_equal, base, before[0])  # the base stays frozen
    assert any(_changed(adapters, before[1])) and any(_changed(critic, before[2]))
