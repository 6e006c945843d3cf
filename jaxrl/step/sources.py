"""Where a step's rollouts come from: one small protocol, one implementation per source.

    source = Jitted(sampler, clock, train_rules=(mesh, rules))   # `rollout_source` picks one
    made = source.next(params, n, batch_of, layout)               # the step's call, for batch n

A source is given what it needs, never the step: the policy's weights (`params`, the
model's `nnx.State`), batch n's arguments (`batch_of(n)`), the phase clock and the rule sets
it traces under. It hands back batch n's (rollout, reward inputs) and the host metrics that
go with them (`Made`); the step scores Python rewards on the host and runs its train program
on them. The learner (`jaxrl.step.learner`) never asks where a rollout came from. Sources:

    InGraph          fused: the rollout is traced into the step's one program (`traced`)
    Jitted           split: a jitted generate program, then the train program
    QueuedRollouts   async (+ in-flight updates): generate on a rollout sub-mesh, batches
                     made ahead in a queue (`jaxrl.step.asynchronous`)
    EpisodeRollouts  multi-turn: the host drives episodes against environments
                     (`jaxrl.step.multiturn`)

Which one a run uses is its plan's (`jaxrl.config.plan.RunPlan`; `jaxrl.step.builder.
build_step` makes it); what the run asks of it beyond `next` it asks the plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.rl import RewardInputs
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.sharding import AxisRules, use_rules
from jaxrl.step.clock import PhaseClock
from jaxrl.step.phases import reward_inputs

# A step's rollout arguments: (prompts, fields_P, rows_P, key).
RolloutArgs = tuple[Prompts, dict[str, jax.Array], jax.Array, jax.Array]
MeshRules = tuple[Mesh, AxisRules]


class Made(NamedTuple):
    """Batch n as a source hands it to the learner: the rollout and its reward inputs (laid
    out for the train program), and host metrics added to the step's after training."""

    rollout: Rollout
    inputs: RewardInputs
    metrics: dict[str, Any]


def rules_context(mesh_rules: MeshRules | None):
    """`use_rules(mesh, rules)`, or a null context without a mesh."""
    return contextlib.nullcontext() if mesh_rules is None else use_rules(*mesh_rules)


def generate_traced(sampler: Sampler, clock: PhaseClock, params: nnx.State, prompts: Prompts,
                    fields_P: dict[str, jax.Array], rows_P: jax.Array, key: jax.Array
                    ) -> tuple[Rollout, RewardInputs]:
    """(traced) The rollout of `prompts` from the policy weights `params` and its reward
    inputs, stamped `start` when the prompts arrive and `generated` when it is complete."""
    # A replicated scalar as the operand: no gather of the prompts to one device.
    ids_BxP = clock.stamp("start", jnp.sum(prompts.mask_BxP, dtype=jnp.int32), prompts.ids_BxP)
    rollout = sampler.generate_traced(params, Prompts(ids_BxP, prompts.mask_BxP), key)
    rollout = rollout.replace(completion_ids_BxC=clock.stamp(
        "generated", rollout.num_steps, rollout.completion_ids_BxC))
    return rollout, reward_inputs(rollout, fields_P, rows_P, sampler.config.num_generations)


class RolloutSource:
    """The protocol, with the defaults of a source that keeps nothing between steps.
    `clock` stamps the phase times (a disabled clock stamps nothing)."""

    def __init__(self, sampler: Sampler, clock: PhaseClock | None = None):
        self.clock = PhaseClock(enabled=False) if clock is None else clock
        self.use_sampler(sampler)

    def use_sampler(self, sampler: Sampler) -> None:
        """Generates with `sampler` from now on; its programs are made again (no cached trace
        of the old sampler can be reused)."""
        self.sampler = sampler
        self._compiled: dict[str, Any] = {}

    @property
    def programs(self) -> tuple[Callable[..., Any], ...]:
        """The source's jitted programs (for the step's compilation count)."""
        return ()

    def next(self, params: nnx.State, n: int, batch_of: Callable[[int], RolloutArgs],
             layout: Any | None) -> Made:
        """Batch n, from the policy weights `params` (before update n). `layout`: the
        compiled train program's input shardings of (state, rollout, inputs, ...), or None
        before it was compiled."""
        raise NotImplementedError

    def compile(self, params: nnx.State, batch: RolloutArgs) -> tuple[dict[str, Any], Any]:
        """({name: Compiled} of the source's programs, the abstract (rollout, inputs) the
        train program receives, with shardings); nothing is executed."""
        raise NotImplementedError

    def train_failed(self, error: BaseException, n: int) -> None:
        """Called when the train program failed on batch n (a note for the error)."""

    def _program(self, name: str, jitted: Callable[..., Any]) -> Callable[..., Any]:
        return self._compiled.get(name, jitted)


class InGraph(RolloutSource):
    """Fused mode: the rollout is part of the step's one program (`traced`, called by the
    step under its train rules; the sampler switches to its rollout rules)."""

    def traced(self, params: nnx.State, prompts: Prompts, fields_P: dict[str, jax.Array],
               rows_P: jax.Array, key: jax.Array) -> tuple[Rollout, RewardInputs]:
        return generate_traced(self.sampler, self.clock, params, prompts, fields_P, rows_P, key)


class Jitted(RolloutSource):
    """Split mode: the rollout is its own jitted program (`generate`, traced under
    `train_rules` as the train program is), sharing the device buffers with the train
    program; the host scores Python rewards between the two."""

    def __init__(self, sampler: Sampler, clock: PhaseClock | None = None, *,
                 train_rules: MeshRules | None = None):
        self.train_rules = train_rules
        super().__init__(sampler, clock)

    def use_sampler(self, sampler: Sampler) -> None:
        super().use_sampler(sampler)
        self._generate = jax.jit(self._generate_body)

    def _generate_body(self, params, prompts, fields_P, rows_P, key):
        with rules_context(self.train_rules):
            return generate_traced(self.sampler, self.clock, params, prompts, fields_P, rows_P,
                                   key)

    @property
    def programs(self) -> tuple[Callable[..., Any], ...]:
        return (self._generate,)

    def next(self, params, n, batch_of, layout) -> Made:
        rollout, inputs = self._program("generate", self._generate)(params, *batch_of(n))
        return Made(rollout, inputs, {})

    def compile(self, params, batch):
        generate = self._generate.lower(params, *batch).compile()
        shapes = jax.eval_shape(self._generate, params, *batch)
        outputs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               shapes, generate.output_shardings)
        self._compiled = {"generate": generate}
        return dict(self._compiled), outputs


