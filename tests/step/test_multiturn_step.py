"""The multi-turn step: observation tokens are out of the loss (their gradient is exactly
zero), and the multi-turn step (`EpisodeRollouts`) runs episodes against an environment with its turn and tool
metrics, compiling its train program once; on the (2, 2, 2) mesh its episodes are one
device's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.envs.base import Observation, ToolStats
from jaxrl.models import Transformer
from jaxrl.rl import JaxReward, PolicyLossConfig, RewardSet
from jaxrl.rollout import Prompts, Rollout, Sampler, SamplerConfig
from jaxrl.rollout.settings import Generation
from jaxrl.sharding import load_layout, make_mesh
from jaxrl.step import create_train_state
from jaxrl.step.builder import Step, build_step
from jaxrl.step.multiturn import EpisodeRollouts, Episodes
from jaxrl.step.multiturn_rollout import MultiTurnConfig
from jaxrl.step.phases import reward_inputs
from tests.conftest import make_tiny_config

CONFIG = make_tiny_config("qwen2")
P, G, PROMPT_LEN, C = 4, 4, 5, 8
MODEL_COLS = 5  # completion columns 0-4: the policy's turn; 5-7: the final observation
OPTIM = OptimSection(lr=1e-2, eps=1e-3, max_grad_norm=1.0)
ALGO = AlgoSection(mode="split", num_minibatches=2, loss=PolicyLossConfig(beta=0.0))


def _turn_reward(inputs):
    """Small ids among the turn's columns only: the same for any observation tokens."""
    ids = inputs.completion_ids_BxC[:, :MODEL_COLS]
    return jnp.mean((ids < CONFIG.vocab_size // 3).astype(jnp.float32), axis=1)


REWARDS = RewardSet([JaxReward("turn", _turn_reward)])


def _train_state():
    layout = load_layout("single")
    return create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM,
                              make_mesh(layout, jax.devices()[:1]), layout.train_rules)


def _rollout(observation_ids, observation_mask: bool) -> tuple[Rollout, Prompts]:
    rng = np.random.default_rng(0)
    b = P * G
    prompts = Prompts(jnp.asarray(rng.integers(6, CONFIG.vocab_size, (P, PROMPT_LEN)), jnp.int32),
                      jnp.ones((P, PROMPT_LEN), jnp.int32))
    turn = rng.integers(6, CONFIG.vocab_size, (b, MODEL_COLS))
    ids = np.concatenate([turn, np.broadcast_to(observation_ids, (b, C - MODEL_COLS))], 1)
    obs = (np.arange(C) >= MODEL_COLS)[None].repeat(b, 0).astype(np.int32)
    logp = np.where(obs, 0.0, -1.5).astype(np.float32)
    rollout = Rollout(jnp.repeat(prompts.ids_BxP, G, 0), jnp.repeat(prompts.mask_BxP, G, 0),
                      jnp.asarray(ids, jnp.int32), jnp.ones((b, C), jnp.int32),
                      jnp.asarray(logp), jnp.asarray(logp), jnp.int32(C), jnp.int32(0),
                      observation_mask_BxC=jnp.asarray(obs) if observation_mask else None)
    return rollout, prompts


def _params_after_update(observation_ids, observation_mask=True):
    ts = _train_state()
    sampler = Sampler(nnx.graphdef(ts.model), SamplerConfig(max_new_tokens=C, num_generations=G))
    graphdef, state = nnx.split(ts)
    step = build_step(ALGO, graphdef, sampler, REWARDS, optim=OPTIM, phase_times=False)
    rollout, prompts = _rollout(observation_ids, observation_mask)
    inputs = reward_inputs(rollout, {}, jnp.arange(P, dtype=jnp.int32), G)
    state, out = step._program(state, rollout, inputs, None, None)
    ts = nnx.merge(graphdef, state)
    return (jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(ts.model, nnx.Param))),
            jax.device_get(out.metrics))


def test_observation_tokens_have_exactly_zero_gradient():
    """The observation sits at the end, so its tokens change nothing the turn's tokens see:
    with the observation mask, two different observations give bit-identical updates;
    without it they are trained on and the updates differ (so the check can fail)."""
    a, metrics_a = _params_after_update([7, 8, 9])
    b, metrics_b = _params_after_update([20, 21, 22])
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert metrics_a["loss/policy"] == metrics_b["loss/policy"]
    assert metrics_a["grad_norm"] > 0
    c, _ = _params_after_update([7, 8, 9], observation_mask=False)
    d, _ = _params_after_update([20, 21, 22], observation_mask=False)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(c), jax.tree.leaves(d),
                                                          strict=True))


class _CountingEnv:
    """Answers every turn with two observation tokens and one tool call; done after two."""

    def __init__(self, row):
        self.turns = 0

    def step(self, turn: str) -> Observation:
        self.turns += 1
        if self.turns >= 2:
            return Observation(done=True)
        return Observation(ids=[7, 8], tools=ToolStats(calls=1, latency_s=0.01))


def test_multiturn_step_runs_episodes_with_turn_and_tool_metrics():
    ts = _train_state()
    stop = 5  # every turn ends at token 5 (kept) or after 6 tokens
    sampler = Sampler(nnx.graphdef(ts.model), SamplerConfig(max_new_tokens=6, num_generations=G))
    config = MultiTurnConfig(Generation(max_new_tokens=6, max_turns=3, max_total_tokens=16),
                             num_slots=8, turn_end_token_ids=(stop,), eos_token_ids=(2,))
    episodes = Episodes(_CountingEnv, [{} for _ in range(2 * P)], lambda text: [9] * len(text),
                        lambda ids: " ".join(map(str, ids)), config)
    graphdef, state = nnx.split(ts)
    step = Step(dataclasses.replace(ALGO), graphdef, EpisodeRollouts(sampler, episodes), REWARDS,
                optim=OPTIM)
    rng = np.random.default_rng(1)
    prompts = Prompts(jnp.asarray(rng.integers(6, CONFIG.vocab_size, (P, PROMPT_LEN)), jnp.int32),
                      jnp.ones((P, PROMPT_LEN), jnp.int32))
    args = (prompts, {}, jnp.arange(P, dtype=jnp.int32))
    step.compile(state, *args, jax.random.key(0))
    for i in range(2):
        state, out = step(state, i, lambda n: (*args, jax.random.key(n)))
        metrics = jax.device_get(out.metrics)
        made = step.source.last_rollout
        # Rows that ended their first turn before the budget got the two observation tokens.
        obs_per_row = made.observation_mask_BxC.sum(1)
        assert set(obs_per_row.tolist()) <= {0, 2} and obs_per_row.max() == 2
        ids = np.asarray(made.rollout.completion_ids_BxC)
        assert np.all(ids[made.observation_mask_BxC.astype(bool)] % 7 < 2)  # 7 or 8
        assert metrics["turns/mean"] == made.num_turns_B.mean() and 1 <= metrics["turns/mean"] <= 2
        assert metrics["tool/calls_per_sample"] == made.tool_calls_B.mean() > 0
        assert abs(metrics["tool/latency_s"] - 0.01) < 1e-6
        for name in ("tool/errors", "tool/timeouts", "env/time_s", "env/wait_s"):
            assert name in metrics
    assert step.num_compilations() == 1


def _episode_step(layout_name, devices):
    """(step, state): the counting environment's multi-turn step on `devices` laid out by
    the sharding preset `layout_name` (its rollout rules split the episodes' slots)."""
    layout = load_layout(layout_name)
    mesh = make_mesh(layout, devices)
    ts = create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM, mesh,
                            layout.train_rules)
    sampler = Sampler(nnx.graphdef(ts.model), SamplerConfig(max_new_tokens=6, num_generations=G),
                      mesh=mesh, rules=layout.rollout_rules)
    config = MultiTurnConfig(Generation(max_new_tokens=6, max_turns=3, max_total_tokens=16),
                             num_slots=8, turn_end_token_ids=(5,), eos_token_ids=(2,))
    episodes = Episodes(_CountingEnv, [{} for _ in range(2 * P)], lambda text: [9] * len(text),
                        lambda ids: " ".join(map(str, ids)), config)
    graphdef, state = nnx.split(ts)
    return Step(ALGO, graphdef, EpisodeRollouts(sampler, episodes), REWARDS, optim=OPTIM,
                mesh=mesh, rules=layout.train_rules), state


def test_on_the_2x2x2_mesh_the_episodes_are_one_devices_and_the_step_trains():
    """data 2 x fsdp 2 x tensor 2: the 8 slots split over data x fsdp (2 per device), KV heads
    and weights over tensor. The first step's episodes (the same initial weights) are the
    single device's token for token; the step then trains, compiled once."""
    rng = np.random.default_rng(1)
    prompts = Prompts(jnp.asarray(rng.integers(6, CONFIG.vocab_size, (P, PROMPT_LEN)), jnp.int32),
                      jnp.ones((P, PROMPT_LEN), jnp.int32))
    args = (prompts, {}, jnp.arange(P, dtype=jnp.int32))
    made = {}
    for name, devices in (("single", jax.devices()[:1]), ("dp_fsdp_tp", jax.devices())):
        step, state = _episode_step(name, devices)
        step.compile(state, *args, jax.random.key(0))
        new_state, out = step(state, 0, lambda n: (*args, jax.random.key(0)))
        made[name] = step.source.last_rollout
    assert dict(step.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    one, mesh = made["single"], made["dp_fsdp_tp"]
    for name in ("completion_ids_BxC", "completion_mask_BxC"):
        np.testing.assert_array_equal(getattr(one.rollout, name), getattr(mesh.rollout, name))
    for name in ("observation_mask_BxC", "turn_starts_BxK", "turn_ends_BxK", "num_turns_B"):
        np.testing.assert_array_equal(getattr(one, name), getattr(mesh, name))
    assert one.observation_mask_BxC.any() and len(set(one.num_turns_B.tolist())) > 1
    for name in ("logp_BxC", "logp_raw_BxC"):
        np.testing.assert_allclose(getattr(mesh.rollout, name), getattr(one.rollout, name),
                                   rtol=1e-5, atol=1e-6)
    metrics = jax.device_get(out.metrics)
    assert np.isfinite(metrics["loss/policy"]) and metrics["grad_norm"] > 0
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True))
    step(new_state, 1, lambda n: (*args, jax.random.key(1)))
    assert step.num_compilations() == 1
