"""The rollout source of a multi-turn task: the host between the policy's turns.

    source = EpisodeRollouts(sampler, Episodes(...), env_rewards=True)
    step = Step(cfg, graphdef, source, rewards, ...)       # or build_step(..., plan=)
    state, out = step(state, n, batch_of)                          # as any step

    (1) rollout   on the host, `jaxrl.step.multiturn_rollout`: every sample's episode, its
                  environment (`Episodes.make_env` of its dataset row) answering each turn
                  in a worker thread; observation tokens are prefilled into the sample's
                  own KV pages, never the history again
    (2) rewards   the task's Python rewards on the decoded trajectory (observations
                  included: a reward can read a tool's result), plus the environment's
                  own reward as the JAX reward "env" where the run adds it
    (3) train     the step's train program, unchanged: observation tokens are attended
                  over but out of the loss (`Rollout.observation_mask_BxC`), so their
                  gradient is exactly zero and the sampler/trainer log-prob comparison
                  covers the policy's tokens only

Why not the fused one-program step: an environment's answer is needed in the middle of the
decode loop, once per turn and sample, at times that differ by slot. Inside one program that
is a host callback per decode iteration (`jax.experimental.io_callback`), which serialises
the device with the host at every token and cannot run an environment while other slots
decode; the host loop can, so multi-turn runs in split mode (`algo.mode: split`).

Metrics added to each step (host values): `turns/mean`, `tool/calls_per_sample`,
`tool/errors`, `tool/timeouts` (per sample), `tool/latency_s` (mean seconds per call),
`env/time_s` (seconds in environments, summed over calls), `env/wait_s` (seconds the decode
loop had no slot to run because every busy one waited on its environment),
`rollout/truncated_frac` and `time/rollout_s` (the host rollout's wall time, from the moment
the previous step's updates are done). An observation refused for token ids outside the
model's vocabulary counts as one of its sample's `tool/errors` (never fed: the episode ends
there).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.envs.base import EnvFactory, EnvFailure, Environment
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.rollout.episode_rows import MultiTurnRollout
from jaxrl.sharding import AxisRules
from jaxrl.step.clock import PhaseClock
from jaxrl.step.multiturn_config import MultiTurnConfig
from jaxrl.step.multiturn_rollout import rollout_multiturn
from jaxrl.step.phases import reward_inputs
from jaxrl.step.sources import Made, RolloutArgs, RolloutSource

ENV_REWARD_FIELD = "env_reward"
envs_logger = logging.getLogger("jaxrl.envs")


@dataclasses.dataclass(frozen=True)
class Episodes:
    """What the host loop needs besides the policy: each row's environment, text <-> ids, and
    the turn limits. `rows` are the task's dataset rows (`rows_P` index them); `spec` names
    the environment in errors (`data.env`)."""

    make_env: EnvFactory
    rows: Sequence[dict[str, Any]]
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    config: MultiTurnConfig
    spec: str | None = None


def env_reward(inputs) -> jax.Array:
    """The environment's reward of each sample (0 where it gave none): the "env" JAX reward."""
    return jnp.nan_to_num(inputs.fields[ENV_REWARD_FIELD], nan=0.0)


def turn_metrics(out: MultiTurnRollout) -> dict[str, float]:
    """The host metrics of one multi-turn rollout (module docstring)."""
    calls = float(out.tool_calls_B.sum())
    return {
        "turns/mean": float(out.num_turns_B.mean()),
        "tool/calls_per_sample": float(out.tool_calls_B.mean()),
        "tool/errors": float(out.tool_errors_B.mean()),
        "tool/timeouts": float(out.tool_timeouts_B.mean()),
        "tool/latency_s": float(out.tool_latency_s_B.sum()) / calls if calls else 0.0,
        "env/time_s": out.env_time_s,
        "env/wait_s": out.env_wait_s,
        "rollout/truncated_frac": float(out.truncated_B.mean()),
        "time/rollout_s": out.wall_s,
    }


class EpisodeRollouts(RolloutSource):
    """The multi-turn rollout source (module docstring). `env_rewards`: the environment's
    own reward is the JAX reward "env" of the run's reward set."""

    def __init__(self, sampler: Sampler, episodes: Episodes, clock: PhaseClock | None = None,
                 *, env_rewards: bool = False):
        super().__init__(sampler, clock)
        self.episodes = episodes
        self.env_rewards = env_rewards
        self.last_rollout: MultiTurnRollout | None = None
        self._vocab_error_logged = False

    def next(self, params: nnx.State, n: int, batch_of: Callable[[int], RolloutArgs],
             layout: Any | None) -> Made:
        """Phases (1) and (2): G episodes of each prompt of batch n, from the policy weights
        `params`, laid out as the compiled train program takes them (`layout`)."""
        prompts, fields_P, rows_P, key = batch_of(n)
        g, e = self.sampler.config.num_generations, self.episodes
        # The rollout's first operation would wait for the previous step's updates anyway;
        # waiting here keeps that wait out of time/rollout_s.
        params = jax.block_until_ready(params)
        out, rollout = run_episodes(nnx.merge(self.sampler.graphdef, params), e, prompts,
                                    rows_P, key, self.sampler.config.sampling, g,
                                    mesh=self.sampler.mesh, rules=self.sampler.rules)
        self.last_rollout = out
        if out.vocab_error is not None and not self._vocab_error_logged:
            self._vocab_error_logged = True
            envs_logger.warning("step %d: %s; that observation is not fed, its episode ends "
                                "there and counts in tool/errors (only the first is "
                                "logged)", n, out.vocab_error)
        inputs = reward_inputs(rollout, fields_P, rows_P, g)
        if self.env_rewards:  # per sample already: not repeated per prompt
            inputs.fields[ENV_REWARD_FIELD] = jnp.asarray(out.reward_B, jnp.float32)
        if layout is not None:  # the host-made arrays, laid out as the compiled program's
            rollout, inputs = jax.device_put((rollout, inputs), tuple(layout[1:3]))
        return Made(rollout, inputs, {k: jnp.float32(v) for k, v in turn_metrics(out).items()})

    def compile(self, params: nnx.State, batch: RolloutArgs) -> tuple[dict[str, Any], Any]:
        """No program of its own (the rollout's operations compile on their first call);
        the (rollout, reward inputs) the train program receives, for the rollout's shapes."""
        prompts, fields_P, rows_P, _ = batch
        b = prompts.ids_BxP.shape[0] * self.sampler.config.num_generations
        c = self.episodes.config.max_total_tokens
        outputs = jax.eval_shape(functools.partial(self._abstract_outputs, b=b, c=c), prompts,
                                 fields_P, rows_P)
        return {}, outputs

    def _abstract_outputs(self, prompts, fields_P, rows_P, *, b, c):
        """The (rollout, reward inputs) the train program receives, for eval_shape."""
        g = self.sampler.config.num_generations
        zeros_BxC = jnp.zeros((b, c), jnp.int32)
        rollout = canonical_rollout(prompts, g, zeros_BxC, zeros_BxC, zeros_BxC, zeros_BxC, 0,
                                    0, zeros_BxC)
        inputs = reward_inputs(rollout, fields_P, rows_P, g)
        if self.env_rewards:
            inputs.fields[ENV_REWARD_FIELD] = jnp.zeros((b,), jnp.float32)
        return rollout, inputs


def run_episodes(model, episodes: Episodes, prompts: Prompts, rows_P, key: jax.Array,
                 sampling, group_size: int, *, mesh: Mesh | None = None,
                 rules: AxisRules | None = None) -> tuple[MultiTurnRollout, Rollout]:
    """G episodes of each prompt, each with the environment of its dataset row: the host
    loop's whole result and the rollout as the train program takes it (training and
    evaluation both run episodes through here); on `mesh` (`rules`: the rollout rules) the
    slots split over its devices."""
    e, g = episodes, group_size
    dataset_rows = np.repeat(np.asarray(rows_P), g)
    envs = [make_environment(e.make_env, e.rows, int(r), i, e.spec)
            for i, r in enumerate(dataset_rows)]
    ids_BxP, mask_BxP = (np.repeat(np.asarray(x), g, axis=0) for x in prompts)
    try:
        out = rollout_multiturn(model, ids_BxP, mask_BxP, envs, e.encode, e.decode, key,
                                e.config, sampling, num_generations=g, mesh=mesh, rules=rules)
    except EnvFailure as failure:
        raise failure.at(e.spec, int(dataset_rows[failure.row])) from failure.__cause__
    r = out.rollout
    return out, canonical_rollout(prompts, g, r.completion_ids_BxC, r.completion_mask_BxC,
                                  r.logp_BxC, r.logp_raw_BxC, r.num_steps,
                                  r.decode_slot_steps, out.observation_mask_BxC)


def make_environment(make_env: EnvFactory, rows: Sequence[dict[str, Any]], dataset_row: int,
                     row: int = 0, spec: str | None = None) -> Environment:
    """`make_env(rows[dataset_row])`, checked to be an environment (EnvFailure otherwise)."""
    try:
        env = make_env(rows[dataset_row])
    except Exception as e:
        raise EnvFailure(f"the factory (row -> Environment) raised {type(e).__name__}: {e}",
                         row=row, spec=spec, dataset_row=dataset_row) from e
    if not callable(getattr(env, "step", None)):
        raise EnvFailure(f"the factory returned a {type(env).__name__}, which has no "
                         f"step(turn) -> Observation method", row=row, spec=spec,
                         dataset_row=dataset_row)
    return env


def canonical_rollout(prompts: Prompts, group_size: int, completion_ids_BxC, completion_mask_BxC,
                      logp_BxC, logp_raw_BxC, num_steps, decode_slot_steps,
                      observation_mask_BxC) -> Rollout:
    """The multi-turn rollout as the train program takes it, in fixed dtypes (the program is
    compiled ahead from these shapes): the prompts repeated G times, prompt-major."""
    def rows(x):
        return jnp.repeat(jnp.asarray(x), group_size, axis=0)

    return Rollout(
        rows(prompts.ids_BxP), rows(prompts.mask_BxP),
        jnp.asarray(completion_ids_BxC, jnp.int32), jnp.asarray(completion_mask_BxC, jnp.int32),
        jnp.asarray(logp_BxC, jnp.float32), jnp.asarray(logp_raw_BxC, jnp.float32),
        jnp.asarray(num_steps, jnp.int32), jnp.asarray(decode_slot_steps, jnp.int32),
        observation_mask_BxC=jnp.asarray(observation_mask_BxC, jnp.int32))
