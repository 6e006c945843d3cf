"""FLOP accounting of the RL step: each phase compiled as a loop-free program, counted by XLA.

    prefill       the sampler's prefill of the P prompts                 x 1
    decode        one decode iteration of the sampler's R rows           x decode steps run:
                  (the engine: its S slots; the dense sampler: B = P·G)    rollout/decode_slot_steps / R
    logprobs      completion_log_probs of one microbatch (old / ref)     x microbatches x (old + KL)
    grad          value_and_grad(microbatch_loss) of one microbatch      x iterations x minibatches
                                                                            x microbatches
    update        the optimizer update                                   x iterations x minibatches
    values        completion_values of one microbatch (PPO's critic,     x microbatches
                  algo.advantage gae: V_old before the updates)
    (with a critic, grad differentiates policy + critic and update applies both optimizers)

These are the functions the step program runs: the rollout's are the engine's own `begin`
and loop `iteration` when the sampler has an engine (every run by default), the dense
sampler's otherwise (`jaxrl.step.rollout_programs` says which and with what shapes); the
train phases' are `jaxrl.step.phases`. They are compiled on abstract inputs of the step's
global shapes with the layers unrolled and the vocabulary-chunk and paged-attention loops
unrolled, so XLA's cost analysis sees every FLOP once (`jaxrl.perf.flops` explains why loops
must go). Two variants:

    model      remat off, whole-vocabulary log-probs: the work the step needs  -> perf/model_flops
    hardware   remat and log-prob chunking as configured (recomputation included)
                                                                               -> perf/xla_flops

Both are compiled for the host CPU, on one device, whatever runs the step: XLA's GPU cost
analysis undercounts fused GEMMs (benchmarks/README.md, "GPU check") and a custom
call (cuDNN attention) adds nothing,
while the CPU count of the same HLO matches the analytic one. So the counts do not depend on
the layout (replicated work on a mesh is not counted) and the programs are never run. Layers
are identical, so a model of L > 2 layers is counted from compiles of 1 and 2 layers,
exactly: f(L) = f(1) + (L - 1) (f(2) - f(1)); compile time does not grow with depth. When
the two variants would be the same program (no remat, no chunking) it is compiled once.

Not counted: the reward, advantage and masking arithmetic (O(B·C) elementwise), and, for the
dense sampler, the sampling of the first token after prefill. The analytic count
(`jaxrl.perf.analytic`) is computed beside both as a cross-check. (old: 0 when the step
makes a single update, whose own forward gives the old log-probs; 1 otherwise.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import AlgoSection
from jaxrl.config.algo import resolve_logprob_chunk
from jaxrl.models import ModelConfig, Transformer
from jaxrl.perf import analytic
from jaxrl.perf.flops import PhaseCount, ProgramCost, StepFlops, extrapolate_layers, program_cost
from jaxrl.rollout.types import SamplerConfig
from jaxrl.step.forward import completion_log_probs, completion_values, prompt_group
from jaxrl.step.rollout_programs import (
    StepShapes,
    analytic_generate,
    decode_rows,
    host_abstract,
    lower_generate,
    lower_on_host,
)
from jaxrl.step.state import TrainState
from jaxrl.step.updates import microbatch_loss
from jaxrl.step.value_model import Critic

PER_LAYER = ("prefill", "decode", "logprobs", "grad", "values")  # programs that run the layers


@dataclasses.dataclass(frozen=True)
class StepAccounting:
    """Model, hardware (XLA) and analytic FLOPs of a step; `decode_steps` counts runs of
    the decode program: `decode_steps(rollout/decode_slot_steps)` of that step."""

    model: StepFlops
    hardware: StepFlops
    analytic: StepFlops
    rows: int  # R, the rows of the decode program counted: the engine's slots, or B

    def decode_steps(self, slot_steps: float) -> float:
        """R-row decode programs of a loop that ran `slot_steps` one-row forward passes (the
        dense sampler: B x (num_steps - 1) over B rows; the engine: its slots summed over its
        iterations, over its S slots: the iterations, a tail tier of fewer slots counting
        as its share of S)."""
        return slot_steps / self.rows

    def metrics(self, decode_steps: float, step_metrics: dict[str, Any] | None = None,
                ) -> dict[str, float | None]:
        """perf/model_flops, perf/xla_flops, perf/analytic_flops of a step. A packed step
        (`step_metrics` holds train/real_token_frac, `jaxrl.step.packing`) counts its train
        phases from the padded programs scaled by the work it did: the model and analytic
        counts by its real tokens (train/real_token_frac of rows x width), the XLA count by
        the rows its forwards ran (train/run_row_frac); a step that ran padded counts the
        padded programs (both fractions 1 on equal lengths)."""
        real, run = (1.0, 1.0) if step_metrics is None else (
            float(step_metrics.get(name, 1.0)) for name in ("train/real_token_frac",
                                                            "train/run_row_frac"))
        return {"perf/model_flops": self.model.total(decode_steps, real),
                "perf/xla_flops": self.hardware.total(decode_steps, run),
                "perf/analytic_flops": self.analytic.total(decode_steps, real)}


def account_step(algo: AlgoSection, model_config: ModelConfig, sampler: SamplerConfig,
                 shapes: StepShapes, ts_graphdef: nnx.GraphDef, ts_state: nnx.State,
                 batch_shards: int = 1) -> StepAccounting:
    """Compiles the phase programs (module docstring) and counts them; `ts_state` (the train
    state, concrete or abstract) gives the optimizer update's shapes; `batch_shards`: the
    devices the step's train batch is split over (`prompt_group`)."""
    # "auto" as the step resolves it (the run's step passes it resolved already).
    algo = dataclasses.replace(algo, logprob_chunk_size=resolve_logprob_chunk(
        algo.logprob_chunk_size, model_config.vocab_size))
    trips = _trips(algo, shapes, model_config, batch_shards)
    layers = model_config.num_layers
    depths = (layers,) if layers <= 2 else (1, 2)
    kinds = {"model": ("none", None)}
    if (model_config.remat, algo.logprob_chunk_size) != ("none", None):
        kinds["hardware"] = (model_config.remat, algo.logprob_chunk_size)
    lowered: dict[tuple[str, int | None, str], jax.stages.Lowered] = {}
    for kind, (remat, chunk) in kinds.items():
        for depth in depths:
            phases = _Phases(algo, model_config, sampler, shapes, trips, remat=remat,
                             chunk_size=chunk, num_layers=depth)
            lowered.update({(kind, depth, name): low for name, low in phases.lower().items()})
        lowered[(kind, None, "update")] = _lower_update(ts_graphdef, ts_state)
    # Tracing is sequential; XLA compiles without the GIL, so the programs (independent of
    # each other) compile in parallel.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = {k: pool.submit(low.compile) for k, low in lowered.items()}
        cost = {k: program_cost(k[2], f.result()) for k, f in futures.items()}

    def count(kind: str) -> StepFlops:
        def phase(name: str) -> ProgramCost:
            if name not in PER_LAYER:
                return cost[(kind, None, name)]
            if len(depths) == 1:
                return cost[(kind, depths[0], name)]
            return extrapolate_layers(cost[(kind, 1, name)], cost[(kind, 2, name)], layers)

        values = (PhaseCount(phase("values"), trips["values"]),) if trips["values"] else ()
        return StepFlops(
            generate=(PhaseCount(phase("prefill"), 1),
                      PhaseCount(phase("decode"), 0, per_decode_step=True)),
            train=(PhaseCount(phase("logprobs"), trips["logprobs"]),
                   PhaseCount(phase("grad"), trips["grad"]),
                   PhaseCount(phase("update"), trips["update"])) + values)

    model = count("model")
    hardware = count("hardware") if "hardware" in kinds else model
    critic = algo.critic.kind if algo.advantage == "gae" else None
    return StepAccounting(model, hardware,
                          _analytic(model_config, sampler, shapes, trips, critic),
                          decode_rows(model_config, sampler, shapes))


def _trips(algo: AlgoSection, shapes: StepShapes, model_config: ModelConfig,
           batch_shards: int = 1) -> dict[str, int]:
    minibatch, num_micro = algo.batch_split(shapes.rows)
    updates = algo.num_iterations * algo.num_minibatches
    micro_rows = minibatch // num_micro
    slices = shapes.rows // micro_rows  # microbatches of the whole batch
    group = prompt_group(algo, model_config, shapes.generations, shapes.rows, slices,
                         batch_shards)
    return {"micro_rows": micro_rows, "prompt_group": group,
            "logprobs": slices * ((not algo.single_update) + (algo.loss.beta > 0)),
            "grad": updates * num_micro, "update": updates,
            "values": slices if algo.advantage == "gae" else 0}


def _analytic(config: ModelConfig, sampler: SamplerConfig, shapes: StepShapes,
              trips: dict[str, int], critic: str | None = None) -> StepFlops:
    """The analytic counts; `critic` (algo.critic.kind when algo.advantage is gae) adds the
    values forward (a trunk whose "vocabulary" is the value head's one column) and, for a
    separate critic, its trunk's share of every gradient (a value head's own: the head)."""
    p, c, b, g = shapes.prompt_len, shapes.max_new_tokens, trips["micro_rows"], trips["prompt_group"]

    def phase(name, flops, n, per_decode_step=False):
        return PhaseCount(ProgramCost(name, flops, None, "analytic"), n, per_decode_step)

    grad = analytic.grad_flops(config, b, p, c, g)
    values = ()
    if critic is not None:
        value_config = dataclasses.replace(config, vocab_size=1)
        trunk = analytic.logprob_flops(value_config, b, p, c, g)
        head = 2.0 * config.hidden_size * b * c
        grad += 3 * (trunk if critic == "separate" else head)
        values = (phase("values", trunk, trips["values"]),)
    prefill, decode = analytic_generate(config, sampler, shapes)
    return StepFlops(
        generate=(phase("prefill", prefill, 1), phase("decode", decode, 0, per_decode_step=True)),
        train=(phase("logprobs", analytic.logprob_flops(config, b, p, c, g), trips["logprobs"]),
               phase("grad", grad, trips["grad"])) + values)


def _lower_update(ts_graphdef: nnx.GraphDef, ts_state: nnx.State) -> jax.stages.Lowered:
    """One optimizer update of the run's train state."""
    state = jax.tree.map(lambda x: host_abstract(x.shape, x.dtype), ts_state)
    ts: TrainState = nnx.merge(ts_graphdef, state)
    grads = jax.tree.map(lambda m: nnx.state(m, nnx.Param), ts.trainable(),
                         is_leaf=lambda x: isinstance(x, nnx.Module))

    def fn(state, grads):
        ts: TrainState = nnx.merge(ts_graphdef, state)
        ts.apply_gradients(grads)
        return nnx.state(ts)

    return lower_on_host(fn, state, grads, donate=(0,))


class _Phases:
    """The per-layer phase programs of one variant, for a model of `num_layers` layers."""

    def __init__(self, algo: AlgoSection, model_config: ModelConfig, sampler: SamplerConfig,
                 shapes: StepShapes, trips: dict[str, int], *, remat: str,
                 chunk_size: int | None, num_layers: int):
        self.algo = dataclasses.replace(algo, logprob_chunk_size=chunk_size)
        self.sampler, self.shapes, self.trips = sampler, shapes, trips
        # XLA's own attention: the same FLOPs as a cuDNN kernel, which the host cannot compile
        # (and whose custom call cost analysis would count as nothing). Experts by gathered
        # weights: the routed experts' FLOPs only, where the host's ragged_dot would count
        # every expert (`ModelConfig.moe_dispatch`).
        config = dataclasses.replace(model_config, scan_layers=False, remat=remat,
                                     num_layers=num_layers, attention_impl="xla",
                                     moe_dispatch="gather")
        self.graphdef, params = nnx.split(
            nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
        self.params = jax.tree.map(lambda x: host_abstract(x.shape, x.dtype), params)
        self.config = config
        self.critic = None  # (graphdef, abstract params) of PPO's critic, with gae
        if algo.advantage == "gae":
            separate = algo.critic.kind == "separate"
            graphdef, params = nnx.split(nnx.eval_shape(lambda: Critic(
                config.hidden_size, Transformer(config, rngs=nnx.Rngs(0)) if separate else None)))
            self.critic = (graphdef, jax.tree.map(lambda x: host_abstract(x.shape, x.dtype), params))

    def lower(self) -> dict[str, jax.stages.Lowered]:
        """The phase programs, traced and lowered (not yet compiled)."""
        programs = {**lower_generate(self.graphdef, self.params, self.config, self.sampler,
                                       self.shapes),
                    "logprobs": self._logprobs(), "grad": self._grad()}
        if self.critic is not None:
            programs["values"] = self._values()
        return programs

    def _rows(self, rows, *tail, dtype=jnp.int32):
        return host_abstract((rows, *tail), dtype)

    # ------------------------------------------------------------------ the programs

    def _microbatch(self) -> dict[str, Any]:
        s, b = self.shapes, self.trips["micro_rows"]
        t, c = s.prompt_len + s.max_new_tokens, s.max_new_tokens
        mb = {"ids_BxT": self._rows(b, t), "mask_BxT": self._rows(b, t, dtype=bool),
              "loss_mask_BxC": self._rows(b, c, dtype=bool)}
        if self.critic is None:
            mb["adv_B"] = self._rows(b, dtype=jnp.float32)
        else:
            for name in ("adv_BxC", "returns_BxC", "old_values_BxC"):
                mb[name] = self._rows(b, c, dtype=jnp.float32)
        if not self.algo.single_update:
            mb["old_logp_BxC"] = self._rows(b, c, dtype=jnp.float32)
        if self.algo.loss.beta > 0:
            mb["ref_logp_BxC"] = self._rows(b, c, dtype=jnp.float32)
        if self.algo.loss.uses_sampler_logp:
            mb["sampler_logp_BxC"] = self._rows(b, c, dtype=jnp.float32)
        return mb

    def _logprobs(self) -> jax.stages.Lowered:
        algo = self.algo

        def fn(params, mb):
            return completion_log_probs(nnx.merge(self.graphdef, params), mb,
                                        self.sampler.sampling.temperature,
                                        algo.logprob_chunk_size, unroll=True,
                                        prompt_group=self.trips["prompt_group"])[0]

        return lower_on_host(fn, self.params, self._microbatch())

    def _grad(self) -> jax.stages.Lowered:
        algo = self.algo
        count = host_abstract((), jnp.int32)

        def fn(params, critic_params, mb, num_tokens, num_seqs):
            def loss(trainable):
                model, critic = trainable if critic_params is not None else (trainable, None)
                return microbatch_loss(algo, model, mb, num_tokens, num_seqs,
                                       self.sampler.sampling.temperature, unroll=True,
                                       prompt_group=self.trips["prompt_group"], critic=critic)

            model = nnx.merge(self.graphdef, params)
            if critic_params is not None:
                model = (model, nnx.merge(self.critic[0], critic_params))
            return nnx.value_and_grad(loss, has_aux=True)(model)

        critic_params = None if self.critic is None else self.critic[1]
        return lower_on_host(fn, self.params, critic_params, self._microbatch(), count, count)

    def _values(self) -> jax.stages.Lowered:
        def fn(params, critic_params, mb):
            return completion_values(nnx.merge(self.critic[0], critic_params), mb,
                                     nnx.merge(self.graphdef, params),
                                     self.trips["prompt_group"])

        return lower_on_host(fn, self.params, self.critic[1], self._microbatch())
