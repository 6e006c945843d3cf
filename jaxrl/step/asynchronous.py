"""Rollout and training on two sub-meshes, batch n trained on a rollout at most k updates old.

    rollout_devices, train_devices = split_devices(4)            # jaxrl.sharding.submeshes
    source = QueuedRollouts(sampler, clock, rollout=(rollout_mesh, rollout_rules),
                            train=(train_mesh, train_rules), max_staleness=1)
    step = Step(cfg, graphdef, source, rewards, mesh=train_mesh, rules=train_rules)
    for n in range(num_steps):
        state, out = step(state, n, batch_of)       # batch_of(m) -> (prompts, fields_P, rows_P, key)

A rollout source (`jaxrl.step.sources`) of the step: two compiled programs on disjoint
devices, *generate* (the sampler, on the rollout mesh, from a copy of the weights held
there) and the step's *train* program (score + advantages + updates, on the train mesh). The schedule is fixed by `max_staleness` k, so a run is deterministic:

    call n:  sync       the train state's weights (n updates) -> the rollout mesh, a
                        device-to-device copy (`jaxrl.sharding.submeshes.move`; no host)
             produce    dispatch generation of every batch up to n + k not yet made, from
                        those weights (at n = 0: batches 0..k, all from the initial weights)
             consume    move batch n's rollout to the train mesh and train on it

Batch n is generated from the weights after min(n, k)-fewer updates than it is trained
against: its staleness is min(n, k). JAX dispatches asynchronously, so generation of
n + k on the rollout devices runs while the train devices work on n; the sync of call n + 1
waits for update n. k = 0 is the synchronous algorithm on two meshes (generate n, then
train n), and gives the synchronous step's numbers (tested). `batch_of(m)` is called once per
batch, in order m = 0, 1, ... (from the step the queue was made at), k batches ahead of
training: a curriculum must see results k steps later than in the synchronous modes.

In-flight weight updates (`inflight_updates`, k >= 2; PipelineRL): batch m is generated in
pieces, one at each call from max(m - k, 0) to max(m - 1, 0), each by the weights synced at
that call (`jaxrl.rollout.inflight`): a piece but the last decodes `piece_steps` =
ceil(max_new_tokens / k) iterations, the last runs to the end and finishes the rollout one
call before it is trained. Three programs replace generate: *start* (prefill and the first
piece), *resume* (a piece, the rollout in progress donated) and *finish* (the rollout and
its reward inputs). Each token keeps the version that drew it, so the staleness metrics are
over tokens, and its behaviour log-prob is under those very weights.

The behaviour log-probs are the sampler's (`Rollout.logp_raw_BxC`); how the loss weighs the
proximal (trainer) against the behaviour (sampler) policy is `loss.correction`.

Metrics added to each step: `async/staleness_mean`, `async/staleness_max` (updates between
the weights that generated the batch and the weights it trains), `async/weight_sync_bytes`
(the bytes of the weights moved). With phase times on, the clock also gets the stamps
`sync_dispatch` / `synced` (a watcher thread waits for the copy on the rollout devices) for
`time/weight_sync_s`, and the generate program stamps `start` / `generated` of each batch
(`jaxrl.step.clock.async_times`: the queue waits of each side).

The queue of made-but-untrained batches (with in-flight updates, some still in flight) is
`pending()` / `resume_with(...)` (checkpoints: `jaxrl.run.async_queue`). Filling it takes
k + 1 generations at call 0; a stop asked for meanwhile (`stop_requested`, set by the
training loop: SIGTERM, Ctrl-C) ends the fill once the batch to train is made, so the run
stops after that step instead of after the whole fill. The batches not made then are made
after the resume from the weights of that time: the one case where a resumed async run
differs from one never stopped (a stop in the steady state, one batch made per call, keeps
the queue whole).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.rollout import Prompts, Sampler
from jaxrl.rollout.inflight import Partial, partial_shardings
from jaxrl.sharding import AxisRules, state_shardings
from jaxrl.sharding.submeshes import move
from jaxrl.step.async_batches import Produced, token_staleness
from jaxrl.step.clock import PhaseClock
from jaxrl.step.phases import reward_inputs
from jaxrl.step.sources import Made, MeshRules, RolloutArgs, RolloutSource, generate_traced


class QueuedRollouts(RolloutSource):
    """The rollout source of algo.mode=async (module docstring).

    `sampler` is built on the rollout mesh with the rollout rules (`rollout`); the step's
    state (donated) and train program live on the train side (`train`: the step's mesh and
    train rules), where each made batch is moved.
    """

    def __init__(self, sampler: Sampler, clock: PhaseClock | None = None, *,
                 rollout: MeshRules, train: MeshRules, max_staleness: int = 1,
                 inflight_updates: bool = False):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or \
                max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        if inflight_updates and max_staleness < 2:
            raise ValueError(f"inflight_updates needs max_staleness >= 2 (a batch is generated "
                             f"within one step otherwise), got {max_staleness}")
        if inflight_updates and sampler.config.engine is None:
            raise ValueError("inflight_updates needs the engine (SamplerConfig.engine)")
        self.rollout_mesh, self.rollout_rules = rollout
        self.train_mesh, self.train_rules = train
        if set(self.train_mesh.devices.flat) & set(self.rollout_mesh.devices.flat):
            raise ValueError("the train and rollout meshes share devices; split them with "
                             "jaxrl.sharding.submeshes.split_devices")
        self.max_staleness = max_staleness
        self.inflight = inflight_updates
        # Decode iterations of each piece but a batch's last (which runs to the end).
        self.piece_steps = -(-sampler.config.max_new_tokens // max(max_staleness, 1))
        self.queue: collections.deque[Produced] = collections.deque()
        self.next_step = 0  # the next batch to produce
        self.sync_bytes = 0
        # Whether a stop (SIGTERM, Ctrl-C) was asked for; the training loop sets it.
        self.stop_requested: Callable[[], bool] = lambda: False
        super().__init__(sampler, clock)
        self._watcher = (concurrent.futures.ThreadPoolExecutor(1, "jaxrl-weight-sync")
                         if self.clock.enabled else None)

    def use_sampler(self, sampler: Sampler) -> None:
        super().use_sampler(sampler)
        self._generate = jax.jit(functools.partial(QueuedRollouts._generate_body, self))
        self._start = jax.jit(functools.partial(QueuedRollouts._start_body, self))
        self._resume = jax.jit(sampler.resume_traced, donate_argnums=1)
        self._finish = jax.jit(functools.partial(QueuedRollouts._finish_body, self))

    @property
    def programs(self) -> tuple[Callable[..., Any], ...]:
        return (self._start, self._resume, self._finish) if self.inflight else (self._generate,)

    def _generate_body(self, params, prompts, fields_P, rows_P, key):
        # The sampler lays out its own work by the rollout rules (`Sampler`).
        return generate_traced(self.sampler, self.clock, params, prompts, fields_P, rows_P, key)

    def _start_body(self, params, prompts, key, version, stop_at):
        ids_BxP = self.clock.stamp("start", jnp.sum(prompts.mask_BxP, dtype=jnp.int32),
                                   prompts.ids_BxP)
        return self.sampler.start_traced(params, Prompts(ids_BxP, prompts.mask_BxP), key,
                                         version, stop_at)

    def _finish_body(self, partial, fields_P, rows_P):
        rollout, version_BxC = self.sampler.finish_traced(partial)
        rollout = rollout.replace(completion_ids_BxC=self.clock.stamp(
            "generated", rollout.num_steps, rollout.completion_ids_BxC))
        return rollout, reward_inputs(rollout, fields_P, rows_P,
                                      self.sampler.config.num_generations), version_BxC

    @staticmethod
    def _rollout_params(params: nnx.State) -> nnx.State:
        """The parameters of the policy's weights `params` (what generation reads)."""
        return nnx.filter_state(params, nnx.Param)

    def sync(self, params: nnx.State) -> nnx.State:
        """The policy's parameters, resharded from the train mesh onto the rollout mesh."""
        params = self._rollout_params(params)
        self.sync_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        dispatched = time.perf_counter()
        copy = move(params, state_shardings(params, self.rollout_mesh, self.rollout_rules))
        if self._watcher is not None:
            self._watcher.submit(self._stamp_sync, dispatched, copy)
        return copy

    def _stamp_sync(self, dispatched: float, copy: nnx.State) -> None:
        jax.block_until_ready(copy)
        self.clock.record("sync_dispatch", dispatched)
        self.clock.record("synced", time.perf_counter())

    def produce(self, params: nnx.State, step: int, version: int, batch: RolloutArgs) -> None:
        """Dispatches generation of batch `step` from `params` (weights after `version`
        updates) and queues it."""
        batch = self._on(self.rollout_mesh, self.rollout_rules, batch)
        if not self.inflight:
            rollout, inputs = self._compiled.get("generate", self._generate)(params, *batch)
            self.queue.append(Produced(step, version, rollout, inputs))
            return
        prompts, fields_P, rows_P, key = batch
        partial = self._compiled.get("start", self._start)(
            params, prompts, key, np.int32(version), self._stop_at(step, version))
        self.queue.append(Produced(step, version, None, None,
                                   partial=(partial, fields_P, rows_P)))
        self._finish_if_due(self.queue[-1], version)

    def _last_piece_call(self, step: int) -> int:
        """The call that generates batch `step`'s last piece (in-flight updates): the one
        before it is trained, or call 0 for batch 0."""
        return max(step - 1, 0)

    def _stop_at(self, step: int, call: int) -> jax.Array:
        """Decode iterations batch `step` has run in all after its piece at call `call`:
        `piece_steps` per call since its first, unbounded at its last."""
        if call >= self._last_piece_call(step):
            return np.int32(np.iinfo(np.int32).max)
        first = max(step - self.max_staleness, 0)
        return np.int32((call - first + 1) * self.piece_steps)

    def _finish_if_due(self, entry: Produced, call: int) -> None:
        if call >= self._last_piece_call(entry.step):
            entry.rollout, entry.inputs, entry.version_BxC = self._compiled.get(
                "finish", self._finish)(*entry.partial)
            entry.partial = None

    def advance_pieces(self, params: nnx.State, call: int) -> None:
        """Each batch in flight decodes its next piece with `params` (the weights after
        `call` updates), oldest first; those whose last piece this is are finished."""
        for entry in self.queue:
            if entry.made:
                continue
            partial, fields_P, rows_P = entry.partial
            partial = self._compiled.get("resume", self._resume)(
                params, partial, np.int32(call), self._stop_at(entry.step, call))
            entry.partial = (partial, fields_P, rows_P)
            self._finish_if_due(entry, call)

    def next(self, params: nnx.State, step: int, batch_of: Callable[[int], RolloutArgs],
             layout: Any | None) -> Made:
        """Syncs the weights, makes the batches due (module docstring) and hands over batch
        `step`, moved onto the train mesh, with its staleness metrics."""
        if self.queue and self.queue[0].step != step or not self.queue and \
                self.next_step not in (0, step):
            raise ValueError(f"the async step was called for step {step}, but its queue starts "
                             f"at {self.queue[0].step if self.queue else self.next_step}")
        if not self.queue:
            self.next_step = step
        try:
            params = self.sync(params)  # `step` updates applied so far (one per step)
            if self.inflight:
                self.advance_pieces(params, step)
            while self.next_step <= step + self.max_staleness:
                # Filling (call 0, or after a resume): a stop ends the fill once this call's
                # batch is made; the one batch of a call in the steady state is always made.
                if step < self.next_step < step + self.max_staleness and self.stop_requested():
                    break
                self.produce(params, self.next_step, step, batch_of(self.next_step))
                self.next_step += 1
        except Exception as e:
            e.add_note(f"async: the rollout side failed at step {step} (making batch "
                       f"{self.next_step}); the train side stops too, its last update was "
                       f"step {step - 1}'s")
            raise
        made = self.queue.popleft()
        rollout, inputs = self._on(self.train_mesh, self.train_rules,
                                   (made.rollout, made.inputs))
        if made.version_BxC is None:
            mean = top = float(step - made.version)
        else:  # per token: the version that drew it
            mean, top = token_staleness(made.version_BxC, made.rollout.completion_mask_BxC,
                                         step)
        return Made(rollout, inputs, {"async/staleness_mean": mean, "async/staleness_max": top,
                                      "async/weight_sync_bytes": float(self.sync_bytes)})

    def train_failed(self, error: BaseException, n: int) -> None:
        ahead = [p.step for p in self.queue]
        error.add_note(f"async: the train side failed at step {n}; the rollout side stops "
                       f"too" + (f", its batches made ahead (steps {ahead[0]}..{ahead[-1]}) "
                                 f"untrained" if ahead else ""))

    def pending(self) -> list[Produced]:
        """The batches made and not yet trained on, oldest first."""
        return list(self.queue)

    def resume_with(self, pending: list[Produced], next_step: int) -> None:
        """Continues a run whose queue held `pending` (restored from a checkpoint; each
        rollout is moved onto the rollout mesh) with `next_step` the next batch to make."""
        def on_rollout_mesh(p: Produced) -> Produced:
            if not p.made:
                partial, fields_P, rows_P = p.partial
                partial = move(partial, partial_shardings(partial, self.rollout_mesh,
                                                          self.rollout_rules))
                rest = self._on(self.rollout_mesh, self.rollout_rules, (fields_P, rows_P))
                return dataclasses.replace(p, partial=(partial, *rest))
            rollout, inputs, version_BxC = self._on(self.rollout_mesh, self.rollout_rules,
                                                    p.saved())
            return dataclasses.replace(p, rollout=rollout, inputs=inputs,
                                       version_BxC=version_BxC)

        self.queue = collections.deque(on_rollout_mesh(p) for p in pending)
        self.next_step = next_step

    def _rollout_args(self, params: nnx.State, batch: RolloutArgs
                      ) -> tuple[nnx.State, RolloutArgs]:
        """(weights as the rollout mesh holds them, abstract; `batch` on the rollout mesh):
        the generate program's arguments."""
        params = self._abstract(self._rollout_params(params), self.rollout_mesh,
                                self.rollout_rules)
        return params, self._on(self.rollout_mesh, self.rollout_rules, batch)

    def abstract_entries(self, params: nnx.State, prompts: Prompts, fields_P, rows_P, key
                         ) -> dict[str, Any]:
        """Shapes, dtypes and shardings of what `Produced.saved` holds of one batch on the
        rollout mesh, for the policy weights `params`: {"made": (rollout, inputs,
        version_BxC)}, and with in-flight updates also {"partial": (partial, fields_P,
        rows_P)}."""
        params, batch = self._rollout_args(params, (prompts, fields_P, rows_P, key))
        mesh, rules = self.rollout_mesh, self.rollout_rules
        if not self.inflight:
            rollout, inputs = jax.eval_shape(self._generate, params, *batch)
            return {"made": self._abstract((rollout, inputs, None), mesh, rules, rows=True)}
        partial = self._abstract_partial(params, batch)
        made = jax.eval_shape(self._finish, partial, *batch[1:3])
        return {"made": self._abstract(made, mesh, rules, rows=True),
                "partial": (partial, *self._abstract(batch[1:3], mesh, rules, rows=True))}

    def _abstract_partial(self, params: nnx.State, batch: RolloutArgs) -> Partial:
        prompts, _, _, key = batch
        one = jax.ShapeDtypeStruct((), jnp.int32)
        partial = jax.eval_shape(self._start, params, prompts, key, one, one)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            partial, partial_shardings(partial, self.rollout_mesh,
                                                       self.rollout_rules))

    def compile(self, params: nnx.State, batch: RolloutArgs) -> tuple[dict[str, Any], Any]:
        """The rollout programs compiled for weights resharded onto the rollout mesh, and the
        abstract (rollout, inputs) on the train mesh; nothing is executed."""
        params, batch = self._rollout_args(params, batch)
        if self.inflight:
            one = jax.ShapeDtypeStruct((), jnp.int32)
            partial = self._abstract_partial(params, batch)
            compiled = {"start": self._start.lower(params, batch[0], batch[3], one,
                                                   one).compile(),
                        "resume": self._resume.lower(params, partial, one, one).compile(),
                        "finish": self._finish.lower(partial, *batch[1:3]).compile()}
            made = jax.eval_shape(self._finish, partial, *batch[1:3])[:2]
        else:
            compiled = {"generate": self._generate.lower(params, *batch).compile()}
            made = jax.eval_shape(self._generate, params, *batch)
        self._compiled = compiled
        return dict(compiled), self._abstract(made, self.train_mesh, self.train_rules,
                                              rows=True)

    @staticmethod
    def _shardings(mesh: Mesh, rules: AxisRules, tree: Any) -> Any:
        """Per array of `tree`: rows split over the batch axes for the per-row arrays (the
        leading axis of the longest leading dimension), replicated otherwise."""
        rows = max((x.shape[0] for x in jax.tree.leaves(tree) if np.ndim(x) >= 1), default=0)

        def sharding(x):
            if np.ndim(x) >= 1 and x.shape[0] == rows:
                return rules.sharding(("batch",) + (None,) * (np.ndim(x) - 1), x.shape, mesh)
            return NamedSharding(mesh, PartitionSpec())

        return jax.tree.map(sharding, tree)

    @classmethod
    def _on(cls, mesh: Mesh, rules: AxisRules, tree: Any) -> Any:
        """Every array of `tree` onto `mesh` (`_shardings`)."""
        return move(tree, cls._shardings(mesh, rules, tree))

    @classmethod
    def _abstract(cls, tree: Any, mesh: Mesh, rules: AxisRules, rows: bool = False) -> Any:
        """ShapeDtypeStructs of `tree` on `mesh`: the parameter layout of `rules`, or with
        `rows` the row layout of `_shardings`."""
        shardings = (cls._shardings(mesh, rules, tree) if rows
                     else state_shardings(tree, mesh, rules))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, shardings)

