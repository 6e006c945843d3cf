"""The RL step: one object that gets batch n's rollout from its source, runs the learner on
it, and owns the compiled programs.

    step = build_step(cfg, graphdef, sampler, rewards, plan=run_plan, optim=optim_cfg,
                      mesh=mesh, rules=train)             # or Step(cfg, graphdef, source, ...)
    state, out = step(state, n, batch_of)       # batch_of(n) -> (prompts, fields_P, rows_P, key)
    out.metrics, out.success_P, out.signal_P    # a StepOutput; state: nnx.split(ts)[1], donated

One call, whatever the source (`jaxrl.step.sources`, chosen once by the plan):

    made        = source.next(policy weights, n, batch_of)   the rollout, its reward inputs
    host_values = RewardSet.score_host(made)                  Python rewards, on the host
    state, out  = train program(state, made, host_values)     the learner (`learn`)

except for the fused source (`InGraph`), whose rollout is traced into the train program:
ONE jitted program, donating the train state, generates, scores (Python rewards through a
host callback), computes advantages and makes every update. Split mode runs the same
functions in the same order in two programs, so for the same seed both give the same
parameters; the reward set sums JAX and host rewards in one fixed order, which keeps the
totals bit-identical.

On a mesh the train program traces under the *train* rules (`use_rules` inside the jitted
function); the sampler switches to its own rollout rules and reshards the weights itself.
The new state is pinned to the shardings of its logical axes, so a donated state keeps its
layout step after step.

Phase times: host callbacks inside the programs stamp when the prompts arrive, when the
rollout is complete and when the last update is done (`PhaseClock.stamp`, wired into the
data flow through the prompt ids, the sampled ids and a metric). `clock.pop()` gives
`time/generate_s` and `time/train_s` of the oldest step not yet popped. Outside the fused
program the train program stamps its own start, so host reward scoring before it counts in
neither.

`compile(...)` compiles the programs ahead of the first call (so their memory analysis is
known before anything runs); later calls run those executables, which never recompile.

`fields_P` (in-graph task fields) and `rows_P` (dataset rows, for the host fields of Python
rewards) are per prompt; they are repeated for the G samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.config.plan import RunPlan
from jaxrl.distributed import from_local_rows, local_rows, process_rows
from jaxrl.rl import RewardInputs, RewardSet
from jaxrl.rollout import Prompts, Sampler
from jaxrl.sharding import AxisRules, state_shardings
from jaxrl.step.asynchronous import QueuedRollouts
from jaxrl.step.clock import PhaseClock
from jaxrl.step.learner import learn
from jaxrl.step.multiturn import EpisodeRollouts, Episodes
from jaxrl.step.optimizer import learning_rate_schedule
from jaxrl.step.sources import (
    InGraph,
    Jitted,
    MeshRules,
    RolloutArgs,
    RolloutSource,
    rules_context,
)
from jaxrl.step.updates import Metrics

__all__ = ["Step", "StepOutput", "build_step", "host_reward_shardings", "score_host_rows"]

class StepOutput(NamedTuple):
    """What a step returns besides the new state: scalar metrics, and for the curriculum each
    prompt's success (the fraction of its G samples solved, `RewardSet.solved`) and learning
    signal (1 where its group's rewards differ)."""

    metrics: Metrics
    success_P: jax.Array
    signal_P: jax.Array


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
    """`step(state, n, batch_of, ref_params=None) -> (new_state, StepOutput)` (module
    docstring).

    `state` is the TrainState's `nnx.State` and is donated (invalid after the call);
    `ref_params` (`reference_params(ts)`) is needed only when `cfg.loss.beta > 0`. Calls come
    in order n = 0, 1, ... where the source makes batches ahead (`QueuedRollouts`).
    `programs` holds the jitted functions: the source's, then the train program (the one
    program of the fused source). `clock` is the source's phase clock: both stamp into it.
    """

    def __init__(self, cfg: AlgoSection, graphdef: nnx.GraphDef, source: RolloutSource,
                 rewards: RewardSet, *, optim: OptimSection | None = None,
                 mesh: Mesh | None = None, rules: AxisRules | None = None):
        if (mesh is None) != (rules is None):
            raise ValueError("pass both mesh and rules (the train rule set), or neither")
        self.cfg, self.graphdef, self.rewards, self.source = cfg, graphdef, rewards, source
        self.mesh, self.rules = mesh, rules
        self._train_rules = None if mesh is None else (mesh, rules)  # traced under these
        self.clock = source.clock
        self.fused = isinstance(source, InGraph)  # decided once: one program, or the source's
        self._schedule = None if optim is None else learning_rate_schedule(optim)
        self._jit()

    @property
    def sampler(self) -> Sampler:
        return self.source.sampler

    @property
    def mode(self) -> str:
        """fused when the rollout is traced into the train program, else split."""
        return "fused" if self.fused else "split"

    def use_sampler(self, sampler: Sampler) -> None:
        """Generates with `sampler` from now on (the memory fit's smaller KV pool): the
        programs are traced and compiled again, by fresh jit wrappers (no cached trace of
        the old sampler can be reused)."""
        self.source.use_sampler(sampler)
        self._jit()

    def _jit(self) -> None:
        self._compiled: dict[str, Any] = {}
        body = self._fused_program if self.fused else self._learn_program
        self._program = jax.jit(body, donate_argnums=0)

    @property
    def programs(self) -> tuple[Callable[..., Any], ...]:
        return (self._program,) if self.fused else (*self.source.programs, self._program)

    def policy_params(self, state: nnx.State) -> nnx.State:
        """The policy model's weights inside a train `state` (not a copy: do not donate)."""
        return nnx.state(nnx.merge(self.graphdef, state).model)

    def __call__(self, state: nnx.State, n: int, batch_of: Callable[[int], RolloutArgs],
                 ref_params: nnx.State | None = None) -> tuple[nnx.State, StepOutput]:
        program = self._compiled.get("step" if self.fused else "train", self._program)
        if self.fused:
            return program(state, *batch_of(n), ref_params)
        layout = getattr(program, "input_shardings", None)
        made = self.source.next(self.policy_params(state), n, batch_of,
                                None if layout is None else layout[0])
        try:
            host_values = (score_host_rows(self.rewards, made.inputs, self.mesh)
                           if self.rewards.python_rewards else None)
            state, out = program(state, made.rollout, made.inputs, host_values, ref_params)
        except Exception as e:
            self.source.train_failed(e, n)
            raise
        out.metrics.update(made.metrics)
        return state, out

    def compile(self, state: nnx.State, prompts: Prompts, fields_P: dict[str, jax.Array],
                rows_P: jax.Array, key: jax.Array, ref_params: nnx.State | None = None,
                ) -> dict[str, Any]:
        """{name: jax Compiled} of the programs for these arguments ("step"; or the source's
        and "train"), compiled now and run by every later call; nothing is executed."""
        batch = (prompts, fields_P, rows_P, key)
        if self.fused:
            self._compiled = {"step": self._program.lower(state, *batch, ref_params).compile()}
            return dict(self._compiled)
        compiled, outputs = self.source.compile(self.policy_params(state), batch)
        compiled["train"] = self._compile_train(state, outputs, ref_params)
        self._compiled = compiled
        return dict(self._compiled)

    def _compile_train(self, state: nnx.State, outputs: tuple[Any, Any],
                       ref_params: nnx.State | None = None) -> Any:
        """The train program compiled for the source's (rollout, reward inputs) `outputs`
        (ShapeDtypeStructs with shardings) and, with Python rewards, the host reward values
        scored between the two."""
        host_values = None
        if self.rewards.python_rewards:
            ids = outputs[0].completion_ids_BxC
            k, b = len(self.rewards.python_rewards), ids.shape[0]
            values_sharding, errors_sharding = host_reward_shardings(self.mesh, ids.sharding)
            host_values = (jax.ShapeDtypeStruct((k, b), jnp.float32, sharding=values_sharding),
                           jax.ShapeDtypeStruct((b,), jnp.float32, sharding=errors_sharding))
        return self._program.lower(state, *outputs, host_values, ref_params).compile()

    def compiled(self) -> dict[str, Any]:
        """{name: jax Compiled} of the programs `compile` made (empty before it ran)."""
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

    def _learn_program(self, state, rollout, inputs, host_values, ref_params, *, fused=False
                       ) -> tuple[nnx.State, StepOutput]:
        """The train program: `learn` on a made rollout, the new state pinned to its layout."""
        with rules_context(self._train_rules):
            if not fused:
                rollout = rollout.replace(completion_ids_BxC=self.clock.stamp(
                    "train_start", rollout.num_steps, rollout.completion_ids_BxC))
            ts = nnx.merge(self.graphdef, state)
            metrics, success_P, signal_P = learn(
                self.cfg, ts, rollout, inputs, host_values, ref_params, rewards=self.rewards,
                sampler=self.sampler.config, lr_schedule=self._schedule)
            new_state = nnx.state(ts)
            if self.mesh is not None:
                new_state = jax.lax.with_sharding_constraint(
                    new_state, state_shardings(new_state, self.mesh, self.rules))
            # A reduction over every new parameter: the stamp waits for the last update.
            params_sum = sum(jnp.sum(x.astype(jnp.float32))
                             for x in jax.tree.leaves(nnx.state(ts.model, nnx.Param)))
            metrics["grad_norm"] = self.clock.stamp("end", params_sum, metrics["grad_norm"])
            return new_state, StepOutput(metrics, self._replicated(success_P),
                                         self._replicated(signal_P))

    def _fused_program(self, state, prompts, fields_P, rows_P, key, ref_params
                       ) -> tuple[nnx.State, StepOutput]:
        """The fused step's one program: the source's traced rollout, then the train body."""
        with rules_context(self._train_rules):
            rollout, inputs = self.source.traced(self.policy_params(state), prompts, fields_P,
                                                 rows_P, key)
        return self._learn_program(state, rollout, inputs, None, ref_params, fused=True)


def build_step(cfg: AlgoSection, graphdef: nnx.GraphDef, sampler: Sampler, rewards: RewardSet,
               *, plan: RunPlan | None = None, optim: OptimSection | None = None,
               mesh: Mesh | None = None, rules: AxisRules | None = None,
               rollout: MeshRules | None = None, episodes: Episodes | None = None,
               env_rewards: bool = False, phase_times: bool = True) -> Step:
    """The step of `plan` (None: `RunPlan(cfg.mode)`) for the TrainState `graphdef`, with
    the one rollout source the plan asks for (module docstring of `jaxrl.step.sources`):

        plan.env set        EpisodeRollouts(episodes)    multi-turn, on the host
        plan.mode async     QueuedRollouts on `rollout` (mesh, rollout rules)
        plan.mode fused     InGraph                      traced into the one program
        plan.mode split     Jitted

    `sampler` is built on `nnx.graphdef(ts.model)` (with the rollout rules on a mesh); `rules`
    are the train rules; `optim` only adds the `lr` metric; `phase_times` puts the phase
    stamps (host callbacks) into the programs.
    """
    if plan is None:
        if cfg.mode == "async":
            raise ValueError("an async step needs its plan (plan=jaxrl.config.plan.plan(...)): "
                             "max_staleness and in-flight updates are decided there")
        plan = RunPlan(cfg.mode)
    clock = PhaseClock(enabled=phase_times)
    train = None if mesh is None else (mesh, rules)
    source: RolloutSource
    if plan.env is not None:
        if episodes is None:
            raise ValueError(f"a multi-turn plan (environment {plan.env!r}) needs episodes=")
        source = EpisodeRollouts(sampler, episodes, clock, env_rewards=env_rewards)
    elif plan.mode == "async":
        if rollout is None or train is None:
            raise ValueError("an async plan needs the train mesh and rules (mesh=, rules=) and "
                             "the rollout's (rollout=)")
        source = QueuedRollouts(sampler, clock, rollout=rollout, train=train,
                                max_staleness=plan.max_staleness,
                                inflight_updates=plan.inflight)
    elif plan.mode == "fused":
        source = InGraph(sampler, clock)
    elif plan.mode == "split":
        source = Jitted(sampler, clock, train_rules=train)
    else:
        raise ValueError(f"plan.mode must be fused, split or async, got {plan.mode!r}")
    return Step(cfg, graphdef, source, rewards, optim=optim, mesh=mesh, rules=rules)
