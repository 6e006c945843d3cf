"""Rollout and training on two sub-meshes, batch n trained on a rollout at most k updates old.

    rollout_devices, train_devices = split_devices(4)            # jaxrl.sharding.submeshes
    step = AsyncStep(cfg, graphdef, sampler, rewards, optim=optim,
                     train=(train_mesh, train_rules), rollout=(rollout_mesh, rollout_rules))
    for n in range(num_steps):
        state, out = step(state, n, batch_of)       # batch_of(m) -> (prompts, fields_P, rows_P, key)

Two compiled programs on disjoint devices: *generate* (the sampler, on the rollout mesh, from
a copy of the weights held there) and *train* (split mode's score + advantages + updates, on
the train mesh). The schedule is fixed by `max_staleness` k, so a run is deterministic:

    call n:  sync       the train state's weights (n updates) -> the rollout mesh, a
                        device-to-device reshard (`jax.device_put` between meshes; no host)
             produce    dispatch generation of every batch up to n + k not yet made, from
                        those weights (at n = 0: batches 0..k, all from the initial weights)
             consume    move batch n's rollout to the train mesh and train on it

Batch n is generated from the weights after min(n, k)-fewer updates than it is trained
against: its staleness is min(n, k). JAX dispatches asynchronously, so generation of
n + k on the rollout devices runs while the train devices work on n; the sync of call n + 1
waits for update n. k = 0 is the synchronous algorithm on two meshes (generate n, then
train n), and gives the synchronous step's numbers (tested).

The behaviour log-probs are the sampler's (`Rollout.logp_raw_BxC`); the trainer's proximal
policy is its own forward at the weights being updated, so `loss.tis_cap` weighs each token
by min(pi_prox / pi_behaviour, cap) (decoupled PPO with truncated importance weights).

Metrics added to each step: `async/staleness_mean`, `async/staleness_max` (updates between
the weights that generated the batch and the weights it trains), `async/weight_sync_bytes`
(the bytes of the weights moved).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import AlgoSection, OptimSection
from jaxrl.rl import RewardInputs, RewardSet
from jaxrl.rollout import Prompts, Rollout, Sampler
from jaxrl.sharding import AxisRules, state_shardings
from jaxrl.step.builder import Step, StepOutput, score_host_rows
from jaxrl.step.phases import generate, reward_inputs

Batch = tuple[Prompts, dict[str, jax.Array], jax.Array, jax.Array]  # prompts, fields, rows, key


@dataclasses.dataclass
class Produced:
    """A rollout dispatched on the rollout mesh, with the weight version it was made from."""

    step: int
    version: int
    rollout: Rollout
    inputs: RewardInputs


class AsyncStep:
    """`step(state, n, batch_of) -> (new_state, StepOutput)` (module docstring).

    `sampler` is built on the rollout mesh with the rollout rules; `state` (the TrainState's
    `nnx.State`, donated) lives on the train mesh. Calls must come in order n = 0, 1, ...
    from the step the queue was made at.
    """

    def __init__(self, cfg: AlgoSection, graphdef: nnx.GraphDef, sampler: Sampler,
                 rewards: RewardSet, *, optim: OptimSection | None = None,
                 train: tuple[Mesh, AxisRules], rollout: tuple[Mesh, AxisRules],
                 max_staleness: int = 1, phase_times: bool = False):
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or \
                max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        if set(train[0].devices.flat) & set(rollout[0].devices.flat):
            raise ValueError("the train and rollout meshes share devices; split them with "
                             "jaxrl.sharding.submeshes.split_devices")
        self.cfg, self.graphdef, self.rewards = cfg, graphdef, rewards
        self.train_mesh, self.train_rules = train
        self.rollout_mesh, self.rollout_rules = rollout
        self.max_staleness = max_staleness
        self.sampler = sampler
        # Split mode's train program: score (host rewards scored between the programs),
        # advantages, updates.
        self.trainer = Step(dataclasses.replace(cfg, mode="split"), graphdef, sampler, rewards,
                            optim=optim, mesh=self.train_mesh, rules=self.train_rules,
                            phase_times=phase_times)
        self._generate = jax.jit(self._generate_body)
        self.queue: collections.deque[Produced] = collections.deque()
        self.next_step = 0  # the next batch to produce
        self.sync_bytes = 0

    def _generate_body(self, params, prompts, fields_P, rows_P, key):
        rollout = generate(self.sampler, params, prompts, key)
        return rollout, reward_inputs(rollout, fields_P, rows_P,
                                      self.sampler.config.num_generations)

    def sync(self, state: nnx.State) -> nnx.State:
        """The policy's weights, resharded from the train mesh onto the rollout mesh."""
        params = nnx.state(nnx.merge(self.graphdef, state).model, nnx.Param)
        self.sync_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        return jax.device_put(params, state_shardings(params, self.rollout_mesh,
                                                      self.rollout_rules))

    def produce(self, params: nnx.State, step: int, version: int, batch: Batch) -> None:
        """Dispatches generation of batch `step` from `params` (weights after `version`
        updates) and queues it."""
        prompts, fields_P, rows_P, key = self._on(self.rollout_mesh, self.rollout_rules, batch)
        rollout, inputs = self._generate(params, prompts, fields_P, rows_P, key)
        self.queue.append(Produced(step, version, rollout, inputs))

    def __call__(self, state: nnx.State, step: int, batch_of: Callable[[int], Batch],
                 ref_params: nnx.State | None = None) -> tuple[nnx.State, StepOutput]:
        if self.queue and self.queue[0].step != step or not self.queue and \
                self.next_step not in (0, step):
            raise ValueError(f"AsyncStep called for step {step}, but its queue starts at "
                             f"{self.queue[0].step if self.queue else self.next_step}")
        if not self.queue:
            self.next_step = step
        params = self.sync(state)  # `step` updates applied so far (one per step)
        while self.next_step <= step + self.max_staleness:
            self.produce(params, self.next_step, step, batch_of(self.next_step))
            self.next_step += 1
        made = self.queue.popleft()
        rollout, inputs = self._on(self.train_mesh, self.train_rules, (made.rollout,
                                                                       made.inputs))
        host_values = (score_host_rows(self.rewards, inputs, self.train_mesh)
                       if self.rewards.python_rewards else None)
        state, out = self.trainer._compiled.get("train", self.trainer._train)(
            state, rollout, inputs, host_values, ref_params)
        staleness = float(step - made.version)
        out.metrics.update({"async/staleness_mean": staleness, "async/staleness_max": staleness,
                            "async/weight_sync_bytes": float(self.sync_bytes)})
        return state, out

    @staticmethod
    def _on(mesh: Mesh, rules: AxisRules, tree: Any) -> Any:
        """Every array of `tree` onto `mesh`: arrays with rows split over the batch axes
        (the leading axis of every per-row array), scalars replicated."""
        rows = max((x.shape[0] for x in jax.tree.leaves(tree) if np.ndim(x) >= 1), default=0)

        def put(x):
            if np.ndim(x) >= 1 and x.shape[0] == rows:
                sharding = rules.sharding(("batch",) + (None,) * (np.ndim(x) - 1), x.shape,
                                          mesh)
            else:
                sharding = NamedSharding(mesh, PartitionSpec())
            return jax.device_put(x, sharding)

        return jax.tree.map(put, tree)
