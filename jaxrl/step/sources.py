"""Where a step's rollouts come from: one small protocol, one implementation per source.

    source = Jitted(sampler)                     # or InGraph, QueuedRollouts, EpisodeRollouts
    step = Step(cfg, graphdef, source, rewards, mesh=mesh, rules=train_rules)
    made = source.next(state, n, batch_of, layout)   # the step's call, for batch n

The learner (`jaxrl.step.learner`) never asks where a rollout came from. A source gives the
step batch n's (rollout, reward inputs) and the host metrics that go with them (`Made`);
the step scores Python rewards on the host and runs its train program on them. Sources:

    InGraph          fused: the rollout is traced into the step's one program
                     (`traced`); `next` is never called
    Jitted           split: a jitted generate program, then the train program
    QueuedRollouts   async (+ in-flight updates): generate on a rollout sub-mesh, batches
                     made ahead in a queue (`jaxrl.step.asynchronous`)
    EpisodeRollouts  multi-turn: the host drives episodes against environments
                     (`jaxrl.step.multiturn`)

What the run needs of a source beyond that is data, not a type test: `max_staleness`
(batches made ahead of training), `keeps_queue` (its queue is checkpointed), `episodes`
(multi-turn: the environments), `decodes_on_host` (no compiled decode loop to count FLOPs
of), `stop_requested` (set by the loop: a stop ends a queue's fill early).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.rl import RewardInputs
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.step.clock import PhaseClock
from jaxrl.step.phases import generate, reward_inputs

Batch = tuple[Prompts, dict[str, jax.Array], jax.Array, jax.Array]  # prompts, fields, rows, key


class Made(NamedTuple):
    """Batch n as a source hands it to the learner: the rollout and its reward inputs (laid
    out for the train program), and host metrics added to the step's after training."""

    rollout: Rollout
    inputs: RewardInputs
    metrics: dict[str, Any]


def generate_traced(sampler: Sampler, clock: PhaseClock, params: nnx.State, prompts: Prompts,
                    fields_P: dict[str, jax.Array], rows_P: jax.Array, key: jax.Array
                    ) -> tuple[Rollout, RewardInputs]:
    """(traced) The rollout of `prompts` from `params` and its reward inputs, stamped
    `start` when the prompts arrive and `generated` when the rollout is complete."""
    # A replicated scalar as the operand: no gather of the prompts to one device.
    ids_BxP = clock.stamp("start", jnp.sum(prompts.mask_BxP, dtype=jnp.int32), prompts.ids_BxP)
    rollout = generate(sampler, params, Prompts(ids_BxP, prompts.mask_BxP), key)
    rollout = rollout.replace(completion_ids_BxC=clock.stamp(
        "generated", rollout.num_steps, rollout.completion_ids_BxC))
    return rollout, reward_inputs(rollout, fields_P, rows_P, sampler.config.num_generations)


class RolloutSource:
    """The protocol, with the defaults of a source that keeps nothing between steps."""

    in_graph = False  # traced into the step's program (fused) instead of `next`
    max_staleness = 0  # batches made ahead of the one trained
    keeps_queue = False  # a queue of batches made ahead, saved with checkpoints
    decodes_on_host = False  # the decode loop runs on the host (no program to count)
    episodes = None  # multi-turn: `jaxrl.step.multiturn.Episodes`

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.step: Any = None  # the `jaxrl.step.builder.Step` bound to it
        # Whether a stop (SIGTERM, Ctrl-C) was asked for; the loop sets it.
        self.stop_requested: Callable[[], bool] = lambda: False
        self._compiled: dict[str, Any] = {}

    def bind(self, step: Any) -> None:
        """Called once by the step that uses this source (its graphdef, clock, train mesh)."""
        self.step = step
        self.use_sampler(self.sampler)

    def use_sampler(self, sampler: Sampler) -> None:
        """Generates with `sampler` from now on; its programs are made again (no cached trace
        of the old sampler can be reused)."""
        self.sampler = sampler
        self._compiled = {}

    @property
    def programs(self) -> tuple[Callable[..., Any], ...]:
        """The source's jitted programs (for the step's compilation count)."""
        return ()

    def next(self, state: nnx.State, n: int, batch_of: Callable[[int], Batch],
             layout: Any | None) -> Made:
        """Batch n, from the weights in `state` (the train state before update n). `layout`:
        the compiled train program's input shardings of (state, rollout, inputs, ...), or
        None before it was compiled."""
        raise NotImplementedError

    def compile(self, state: nnx.State, batch: Batch) -> tuple[dict[str, Any], Any]:
        """({name: Compiled} of the source's programs, the abstract (rollout, inputs) the
        train program receives, with shardings); nothing is executed."""
        raise NotImplementedError

    def train_failed(self, error: BaseException, n: int) -> None:
        """Called when the train program failed on batch n (a note for the error)."""

    def _program(self, name: str, jitted: Callable[..., Any]) -> Callable[..., Any]:
        return self._compiled.get(name, jitted)


def traced_rollout(source: RolloutSource, state: nnx.State, prompts: Prompts,
                   fields_P: dict[str, jax.Array], rows_P: jax.Array, key: jax.Array
                   ) -> tuple[Rollout, RewardInputs]:
    """(traced) `generate_traced` from the policy inside the train `state`, under the train
    rules of the step `source` is bound to (the sampler switches to its rollout rules)."""
    step = source.step
    with step.rules_context():
        model = nnx.merge(step.graphdef, state).model
        return generate_traced(source.sampler, step.clock, nnx.state(model), prompts,
                               fields_P, rows_P, key)


class InGraph(RolloutSource):
    """Fused mode: the rollout is part of the step's one program (`traced`)."""

    in_graph = True

    def traced(self, state: nnx.State, prompts: Prompts, fields_P: dict[str, jax.Array],
               rows_P: jax.Array, key: jax.Array) -> tuple[Rollout, RewardInputs]:
        return traced_rollout(self, state, prompts, fields_P, rows_P, key)


class Jitted(RolloutSource):
    """Split mode: the rollout is its own jitted program (`generate`), sharing the device
    buffers with the train program; the host scores Python rewards between the two."""

    def use_sampler(self, sampler: Sampler) -> None:
        super().use_sampler(sampler)
        self._generate = jax.jit(functools.partial(traced_rollout, self))

    @property
    def programs(self) -> tuple[Callable[..., Any], ...]:
        return (self._generate,)

    def next(self, state, n, batch_of, layout) -> Made:
        rollout, inputs = self._program("generate", self._generate)(state, *batch_of(n))
        return Made(rollout, inputs, {})

    def compile(self, state, batch):
        generate = self._generate.lower(state, *batch).compile()
        shapes = jax.eval_shape(self._generate, state, *batch)
        outputs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               shapes, generate.output_shardings)
        self._compiled = {"generate": generate}
        return dict(self._compiled), outputs
