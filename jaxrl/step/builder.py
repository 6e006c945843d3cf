"""The step builder: one RL step (generate -> score -> advantages -> updates) as compiled programs.

    step = build_step(cfg, graphdef, sampler, rewards, optim=optim_cfg, mesh=mesh, rules=train)
    state, out = step(state, prompts, fields_P, rows_P, key)   # state: nnx.split(ts)[1]
    out.metrics, out.success_P, out.signal_P                   # a StepOutput

Modes (`AlgoSection.mode`):

    fused  ONE jitted program, donating the train state: generate, score (Python rewards run
           through a host callback), advantages, every optimizer update.
    split  two jitted programs sharing device buffers: (1) generate, (2) score + advantages
           + updates (donating the train state); between them the host runs
           `RewardSet.score_host` on the rollout and passes the values to (2).

Both run the same phase functions (`jaxrl.step.phases`) in the same order, so for the same
seed they give the same parameters. In split mode all of `RewardSet.score` (its JAX rewards
too) runs in program (2): the set sums JAX and host rewards in one fixed order, which keeps
the totals bit-identical to the fused program's.

On a mesh the whole program traces under the *train* rules (`use_rules` inside the jitted
function); the sampler switches to its own rollout rules and reshards the weights itself.
The new state is pinned to the shardings of its logical axes, so a donated state keeps its
layout step after step.

Phase times: host callbacks inside the programs stamp when the prompts arrive, when the
rollout is complete and when the last update is done (`PhaseClock.stamp`, wired into the
data flow through the prompt ids, the sampled ids and a metric). `clock.pop()` gives `time/generate_s` and
`time/train_s` of the oldest step not yet popped. In split mode the train program stamps its
own start, so host reward scoring between the programs counts in neither.

`compile(...)` compiles the program(s) ahead of the first call (so their memory analysis is
known before anything runs); later calls run those executables, which never recompile.

`fields_P` (in-graph task fields) and `rows_P` (dataset rows, for the host fields of Python
rewards) are per prompt; they are repeated for the G samples.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.distributed import from_local_rows, local_rows, process_rows
from jaxrl.rl import RewardInputs, RewardSet, zero_std_groups
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.sharding import AxisRules, state_shardings, use_rules
from jaxrl.step.clock import PhaseClock
from jaxrl.step.critic import gae_batch
from jaxrl.step.optimizer import learning_rate_schedule
from jaxrl.step.phases import (
    advantages,
    completion_metrics,
    generate,
    reward_inputs,
    score,
    shape_rewards,
    train_batch,
    train_on,
)

__all__ = ["Step", "StepOutput", "build_step", "host_reward_shardings", "score_host_rows"]

Metrics = dict[str, jax.Array]


class StepOutput(NamedTuple):
    """What a step returns besides the new state: scalar metrics, and for the curriculum each
    prompt's success (the fraction of its G samples solved, `RewardSet.solved`) and learning
    signal (1 where its group's rewards differ)."""

    metrics: Metrics
    success_P: jax.Array
    signal_P: jax.Array


def prompt_success(rewards: RewardSet, rewards_B: jax.Array, group_size: int) -> jax.Array:
    """success_P = the fraction of a prompt's G samples that solved it (`RewardSet.solved`).
    Partial credit does not count: a group whose samples all earn the same partial credit
    gives no learning signal either."""
    solved_B = rewards.solved(rewards_B)
    return jnp.mean(solved_B.reshape(-1, group_size), axis=1, dtype=jnp.float32)


def host_reward_shardings(mesh: Mesh | None, completions: jax.sharding.Sharding
                          ) -> tuple[jax.sharding.Sharding | None, jax.sharding.Sharding | None]:
    """Shardings of the host rewards' (values_KxB, errors_B): rows split like the
    completions' (None, unconstrained, without a mesh)."""
    if mesh is None:
        return None, None
    rows = completions.spec[0] if isinstance(completions, NamedSharding) and len(
        completions.spec) else None
    return NamedSharding(mesh, PartitionSpec(None, rows)), NamedSharding(mesh, PartitionSpec(rows))


def score_host_rows(rewards: RewardSet, inputs: RewardInputs, mesh: Mesh | None
                    ) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray]:
    """`rewards.score_host` of the rows this process holds, as global arrays (values_KxB,
    errors_B) with rows split like the completions: in a run of several processes each
    scores only its own rows (single process: all of them, as numpy arrays)."""
    if jax.process_count() == 1:
        return rewards.score_host(inputs)
    local = RewardInputs(*(local_rows(x) for x in (
        inputs.prompt_ids_BxP, inputs.prompt_mask_BxP, inputs.completion_ids_BxC,
        inputs.completion_mask_BxC)), fields={}, rows_B=local_rows(inputs.rows_B))
    values_Kxb, errors_b = rewards.score_host(local)
    ids = inputs.completion_ids_BxC
    values_sharding, errors_sharding = host_reward_shardings(mesh, ids.sharding)
    if not np.array_equal(process_rows(ids.sharding, ids.shape),
                          process_rows(errors_sharding, ids.shape[:1])):
        raise ValueError(f"completion rows are sharded as {ids.sharding}, which is not a "
                         f"split of rows over mesh axes")
    k, b = values_Kxb.shape[0], ids.shape[0]
    return (from_local_rows(values_sharding, values_Kxb, (k, b), axis=1),
            from_local_rows(errors_sharding, errors_b, (b,)))


class Step:
    """`step(state, prompts, fields_P, rows_P, key, ref_params=None) -> (new_state, StepOutput)`.

    `state` is the TrainState's `nnx.State` and is donated (invalid after the call);
    `ref_params` (`reference_params(ts)`) is needed only when `cfg.loss.beta > 0`. `programs`
    holds the jitted functions (one when fused, two when split). `mode`: fused or split, as
    the run's plan decided (`jaxrl.config.plan`; None: `cfg.mode`).
    """

    def __init__(self, cfg: AlgoSection, graphdef: nnx.GraphDef, sampler: Sampler,
                 rewards: RewardSet, *, optim: OptimSection | None = None,
                 mesh: Mesh | None = None, rules: AxisRules | None = None,
                 phase_times: bool = True, mode: str | None = None):
        if (mesh is None) != (rules is None):
            raise ValueError("pass both mesh and rules (the train rule set), or neither")
        self.mode = cfg.mode if mode is None else mode
        if self.mode not in ("fused", "split"):
            raise ValueError(f"a Step runs in mode fused or split, got {self.mode!r}")
        self.cfg, self.graphdef, self.rewards = cfg, graphdef, rewards
        self.mesh, self.rules = mesh, rules
        self._schedule = None if optim is None else learning_rate_schedule(optim)
        self.clock = PhaseClock(enabled=phase_times)
        self.use_sampler(sampler)

    def use_sampler(self, sampler: Sampler) -> None:
        """Generates with `sampler` from now on (the memory fit's smaller KV pool): the
        program(s) are traced and compiled again, by fresh jit wrappers (no cached trace of
        the old sampler can be reused)."""
        self.sampler = sampler
        self._compiled: dict[str, Any] = {}
        if self.mode == "fused":
            self._fused = jax.jit(functools.partial(Step._fused_body, self), donate_argnums=0)
            self.programs: tuple[Callable[..., Any], ...] = (self._fused,)
        else:
            self._generate = jax.jit(functools.partial(Step._generate_body, self))
            self._train = jax.jit(functools.partial(Step._train_body, self), donate_argnums=0)
            self.programs = (self._generate, self._train)

    def __call__(self, state: nnx.State, prompts: Prompts, fields_P: dict[str, jax.Array],
                 rows_P: jax.Array, key: jax.Array, ref_params: nnx.State | None = None,
                 ) -> tuple[nnx.State, StepOutput]:
        if self.mode == "fused":
            fused = self._compiled.get("step", self._fused)
            return fused(state, prompts, fields_P, rows_P, key, ref_params)
        rollout, inputs = self._compiled.get("generate", self._generate)(
            state, prompts, fields_P, rows_P, key)
        host_values = (score_host_rows(self.rewards, inputs, self.mesh)
                       if self.rewards.python_rewards else None)
        return self._compiled.get("train", self._train)(state, rollout, inputs, host_values,
                                                        ref_params)

    def step_at(self, state: nnx.State, step: int, batch_of: Callable[[int], tuple[Any, ...]],
                ref_params: nnx.State | None = None) -> tuple[nnx.State, StepOutput]:
        """Step `step` on `batch_of(step)` = (prompts, fields_P, rows_P, key): the loop's call,
        shared with `AsyncStep`, which draws batches ahead."""
        return self(state, *batch_of(step), ref_params)

    def compile(self, state: nnx.State, prompts: Prompts, fields_P: dict[str, jax.Array],
                rows_P: jax.Array, key: jax.Array, ref_params: nnx.State | None = None,
                ) -> dict[str, Any]:
        """{name: jax Compiled} of the program(s) for these arguments ("step", or "generate"
        and "train"), compiled now and run by every later call; nothing is executed."""
        if self.mode == "fused":
            self._compiled = {"step": self._fused.lower(
                state, prompts, fields_P, rows_P, key, ref_params).compile()}
            return dict(self._compiled)
        generate = self._generate.lower(state, prompts, fields_P, rows_P, key).compile()
        shapes = jax.eval_shape(self._generate, state, prompts, fields_P, rows_P, key)
        outputs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               shapes, generate.output_shardings)
        self._compiled = {"generate": generate,
                          "train": self.compile_train(state, outputs, ref_params)}
        return dict(self._compiled)

    def compile_train(self, state: nnx.State, outputs: tuple[Any, Any],
                      ref_params: nnx.State | None = None) -> Any:
        """The split train program compiled for the generate program's (rollout, reward
        inputs) `outputs` (ShapeDtypeStructs with shardings) and, with Python rewards, the
        host reward values scored between the two."""
        host_values = None
        if self.rewards.python_rewards:
            ids = outputs[0].completion_ids_BxC
            k, b = len(self.rewards.python_rewards), ids.shape[0]
            values_sharding, errors_sharding = host_reward_shardings(self.mesh, ids.sharding)
            host_values = (jax.ShapeDtypeStruct((k, b), jnp.float32, sharding=values_sharding),
                           jax.ShapeDtypeStruct((b,), jnp.float32, sharding=errors_sharding))
        return self._train.lower(state, *outputs, host_values, ref_params).compile()

    def compiled(self) -> dict[str, Any]:
        """{name: jax Compiled} of the program(s) `compile` made (empty before it ran)."""
        return dict(self._compiled)

    def num_compilations(self) -> int | None:
        """Programs compiled for the step so far (1 per program when nothing recompiled)."""
        sizes = [getattr(p, "_cache_size", None) for p in self.programs]
        if None in sizes:
            return None
        return len(self._compiled) + sum(size() for size in sizes)

    def _replicated(self, x: jax.Array) -> jax.Array:
        """`x` on every device: each process of a multi-process run reads all of it."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))

    def _rules(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_rules(self.mesh, self.rules)

    def _generate_body(self, state, prompts, fields_P, rows_P, key
                       ) -> tuple[Rollout, RewardInputs]:
        with self._rules():
            model = nnx.merge(self.graphdef, state).model
            # A replicated scalar as the operand: no gather of the prompts to one device.
            ids_BxP = self.clock.stamp("start", jnp.sum(prompts.mask_BxP, dtype=jnp.int32),
                                       prompts.ids_BxP)
            rollout = generate(self.sampler, nnx.state(model), Prompts(ids_BxP, prompts.mask_BxP),
                               key)
            rollout = rollout.replace(completion_ids_BxC=self.clock.stamp(
                "generated", rollout.num_steps, rollout.completion_ids_BxC))
            return rollout, reward_inputs(rollout, fields_P, rows_P,
                                          self.sampler.config.num_generations)

    def _train_body(self, state, rollout, inputs, host_values, ref_params, *, fused=False
                    ) -> tuple[nnx.State, StepOutput]:
        g = self.sampler.config.num_generations
        with self._rules():
            if not fused:
                rollout = rollout.replace(completion_ids_BxC=self.clock.stamp(
                    "train_start", rollout.num_steps, rollout.completion_ids_BxC))
            ts = nnx.merge(self.graphdef, state)
            rewards_B, metrics = score(self.rewards, inputs, host_values)
            success_P = self._replicated(prompt_success(self.rewards, rewards_B, g))
            # 1 where the group's rewards differ: it has a group-relative advantage.
            signal_P = self._replicated(
                1.0 - zero_std_groups(rewards_B, g)[::g].astype(jnp.float32))
            rewards_B, shaping_metrics = shape_rewards(self.cfg, rewards_B,
                                                       rollout.completion_mask_BxC)
            metrics.update(shaping_metrics)
            # Observation tokens of a multi-turn rollout are attended over, never trained on.
            adv_B, loss_mask_BxC, adv_metrics = advantages(
                self.cfg, rewards_B, rollout.model_token_mask(), g)
            metrics.update(adv_metrics)
            metrics.update(completion_metrics(rollout, self.sampler.config.stop_token_ids))
            batch = train_batch(rollout, adv_B, loss_mask_BxC)
            if self.cfg.advantage == "gae":
                batch, value_metrics = gae_batch(self.cfg, ts, batch, g)
                metrics.update(value_metrics)
            metrics.update(train_on(self.cfg, ts, batch,
                                    self.sampler.config.sampling.temperature,
                                    ref_params=ref_params, lr_schedule=self._schedule,
                                    group_size=g))
            new_state = nnx.state(ts)
            if self.mesh is not None:
                new_state = jax.lax.with_sharding_constraint(
                    new_state, state_shardings(new_state, self.mesh, self.rules))
            # A reduction over every new parameter: the stamp waits for the last update.
            params_sum = sum(jnp.sum(x.astype(jnp.float32))
                             for x in jax.tree.leaves(nnx.state(ts.model, nnx.Param)))
            metrics["grad_norm"] = self.clock.stamp("end", params_sum, metrics["grad_norm"])
            return new_state, StepOutput(metrics, success_P, signal_P)

    def _fused_body(self, state, prompts, fields_P, rows_P, key, ref_params
                    ) -> tuple[nnx.State, StepOutput]:
        rollout, inputs = self._generate_body(state, prompts, fields_P, rows_P, key)
        return self._train_body(state, rollout, inputs, None, ref_params, fused=True)


def build_step(cfg: AlgoSection, graphdef: nnx.GraphDef, sampler: Sampler, rewards: RewardSet,
               *, optim: OptimSection | None = None, mesh: Mesh | None = None,
               rules: AxisRules | None = None, phase_times: bool = True,
               mode: str | None = None) -> Step:
    """The RL step of `mode` (None: `cfg.mode`) for the TrainState `graphdef` (see the
    module docstring).

    `sampler` is built on `nnx.graphdef(ts.model)` (with the rollout rules on a mesh); `rules`
    are the train rules; `optim` only adds the `lr` metric; `phase_times` puts the phase
    stamps (host callbacks) into the programs.
    """
    return Step(cfg, graphdef, sampler, rewards, optim=optim, mesh=mesh, rules=rules,
                phase_times=phase_times, mode=mode)
