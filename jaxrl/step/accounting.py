"""FLOP accounting of the RL step: each phase compiled as a loop-free program, counted by XLA.

    prefill       sampler.prefill of the P prompts                       x 1
    decode        sampler.decode_step + sample_rows of the B = P·G rows  x decode steps run:
                  rollout/decode_slot_steps / B (the engine's slots can be fewer than B)
    logprobs      completion_log_probs of one microbatch (old / ref)     x microbatches x (old + KL)
    grad          value_and_grad(microbatch_loss) of one microbatch      x iterations x minibatches
                                                                            x microbatches
    update        the optimizer update                                   x iterations x minibatches
    values        completion_values of one microbatch (PPO's critic,     x microbatches
                  algo.advantage gae: V_old before the updates)
    (with a critic, grad differentiates policy + critic and update applies both optimizers)

These are the functions the step program runs (`jaxrl.rollout.sampler`, `jaxrl.step.phases`),
compiled on abstract inputs of the step's global shapes with the layers unrolled and the
vocabulary-chunk loop unrolled, so XLA's cost analysis sees every FLOP once
(`jaxrl.perf.flops` explains why loops must go). Two variants:

    model      remat off, whole-vocabulary log-probs: the work the step needs  -> perf/model_flops
    hardware   remat and log-prob chunking as configured (recomputation included)
                                                                               -> perf/xla_flops

Both are compiled for the host CPU, on one device, whatever runs the step: XLA's GPU cost
analysis undercounts fused GEMMs (measured on an H200 with jax 0.11: 0.1-0.6x the matmul
FLOPs of train programs; jax-ml/jax#22249) and a custom call (cuDNN attention) adds nothing,
while the CPU count of the same HLO matches the analytic one. So the counts do not depend on
the layout (replicated work on a mesh is not counted) and the programs are never run. Layers
are identical, so a model of L > 2 layers is counted from compiles of 1 and 2 layers,
exactly: f(L) = f(1) + (L - 1) (f(2) - f(1)); compile time does not grow with depth. When
the two variants would be the same program (no remat, no chunking) it is compiled once.

Not counted: the reward, advantage and masking arithmetic (O(B·C) elementwise), and the
sampling of the first token after prefill. The analytic count (`jaxrl.perf.analytic`) is
computed beside both as a cross-check. (old: 0 when the step makes a single update, whose
own forward gives the old log-probs; 1 otherwise.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxrl.config import AlgoSection
from jaxrl.config.algo import resolve_logprob_chunk
from jaxrl.models import KVCache, ModelConfig, Transformer
from jaxrl.perf import analytic
from jaxrl.perf.flops import PhaseCount, ProgramCost, StepFlops, extrapolate_layers, program_cost
from jaxrl.rollout.sampler import decode_step, prefill
from jaxrl.rollout.sampling import sample_rows
from jaxrl.rollout.types import SamplerConfig
from jaxrl.step.forward import completion_log_probs, completion_values, prompt_group
from jaxrl.step.phases import microbatch_loss
from jaxrl.step.state import TrainState
from jaxrl.step.value_model import Critic

PER_LAYER = ("prefill", "decode", "logprobs", "grad", "values")  # programs that run the layers


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The static shapes of one RL step."""

    prompts: int  # P
    prompt_len: int  # padded prompt length
    generations: int  # G
    max_new_tokens: int  # C

    @property
    def rows(self) -> int:
        return self.prompts * self.generations


@dataclasses.dataclass(frozen=True)
class StepAccounting:
    """Model, hardware (XLA) and analytic FLOPs of a step; `decode_steps` counts B-row
    decode steps: `decode_steps(rollout/decode_slot_steps)` of that step."""

    model: StepFlops
    hardware: StepFlops
    analytic: StepFlops
    rows: int  # B, the rows of the decode program counted

    def decode_steps(self, slot_steps: float) -> float:
        """B-row decode steps of a loop that ran `slot_steps` one-row forward passes (the
        dense sampler: B x (num_steps - 1); the engine: its slots summed over iterations)."""
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
    return StepAccounting(model, hardware, _analytic(model_config, shapes, trips, critic),
                          shapes.rows)


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


def _analytic(config: ModelConfig, shapes: StepShapes, trips: dict[str, int],
              critic: str | None = None) -> StepFlops:
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
    return StepFlops(
        generate=(phase("prefill", analytic.prefill_flops(config, shapes.prompts, p, c), 1),
                  phase("decode", analytic.decode_step_flops(config, shapes.rows, p, c), 0,
                        per_decode_step=True)),
        train=(phase("logprobs", analytic.logprob_flops(config, b, p, c, g), trips["logprobs"]),
               phase("grad", grad, trips["grad"])) + values)


def _host() -> SingleDeviceSharding:
    """Where the accounting programs are compiled (never run): the first CPU device."""
    return SingleDeviceSharding(jax.devices("cpu")[0])


def _abstract(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_host())


def _lower(fn, *args, donate: tuple[int, ...] = ()) -> jax.stages.Lowered:
    """`fn(*args)` lowered for the host CPU; `donate`: arguments the step updates in place
    (the KV cache, the train state), so XLA's bytes accessed count no copy of them."""
    return jax.jit(fn, donate_argnums=donate).lower(*args)


def _lower_update(ts_graphdef: nnx.GraphDef, ts_state: nnx.State) -> jax.stages.Lowered:
    """One optimizer update of the run's train state."""
    state = jax.tree.map(lambda x: _abstract(x.shape, x.dtype), ts_state)
    ts: TrainState = nnx.merge(ts_graphdef, state)
    grads = jax.tree.map(lambda m: nnx.state(m, nnx.Param), ts.trainable(),
                         is_leaf=lambda x: isinstance(x, nnx.Module))

    def fn(state, grads):
        ts: TrainState = nnx.merge(ts_graphdef, state)
        ts.apply_gradients(grads)
        return nnx.state(ts)

    return _lower(fn, state, grads, donate=(0,))


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
        self.params = jax.tree.map(lambda x: _abstract(x.shape, x.dtype), params)
        self.config = config
        self.critic = None  # (graphdef, abstract params) of PPO's critic, with gae
        if algo.advantage == "gae":
            separate = algo.critic.kind == "separate"
            graphdef, params = nnx.split(nnx.eval_shape(lambda: Critic(
                config.hidden_size, Transformer(config, rngs=nnx.Rngs(0)) if separate else None)))
            self.critic = (graphdef, jax.tree.map(lambda x: _abstract(x.shape, x.dtype), params))

    def lower(self) -> dict[str, jax.stages.Lowered]:
        """The phase programs, traced and lowered (not yet compiled)."""
        programs = {"prefill": self._prefill(), "decode": self._decode(),
                    "logprobs": self._logprobs(), "grad": self._grad()}
        if self.critic is not None:
            programs["values"] = self._values()
        return programs

    def _rows(self, rows, *tail, dtype=jnp.int32):
        return _abstract((rows, *tail), dtype)

    # ------------------------------------------------------------------ the programs

    def _prefill(self) -> jax.stages.Lowered:
        s = self.shapes

        def fn(params, ids_BxP, mask_BxP):
            return prefill(nnx.merge(self.graphdef, params), ids_BxP, mask_BxP,
                           s.max_new_tokens)

        return _lower(fn, self.params, self._rows(s.prompts, s.prompt_len),
                      self._rows(s.prompts, s.prompt_len, dtype=jnp.bool_))

    def _decode(self) -> jax.stages.Lowered:
        s, cfg = self.shapes, self.config
        slots = s.prompt_len + s.max_new_tokens - 1
        kv_shape = (cfg.num_layers, s.rows, slots, cfg.num_kv_heads, cfg.head_dim)
        kv = _abstract(kv_shape, cfg.compute_dtype)
        cache = KVCache(kv, kv, self._rows(s.rows, slots, dtype=jnp.bool_),
                        _abstract((), jnp.int32))

        def fn(params, token_B, position_B, cache, key_data_Bx2, t):
            logits_BxV, cache = decode_step(nnx.merge(self.graphdef, params), token_B,
                                            position_B, cache)
            keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
                jax.random.wrap_key_data(key_data_Bx2), t)
            return sample_rows(keys_B, logits_BxV, self.sampler.sampling), cache

        return _lower(fn, self.params, self._rows(s.rows), self._rows(s.rows), cache,
                      self._rows(s.rows, 2, dtype=jnp.uint32), _abstract((), jnp.int32),
                      donate=(3,))

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

        return _lower(fn, self.params, self._microbatch())

    def _grad(self) -> jax.stages.Lowered:
        algo = self.algo
        count = _abstract((), jnp.int32)

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
        return _lower(fn, self.params, critic_params, self._microbatch(), count, count)

    def _values(self) -> jax.stages.Lowered:
        def fn(params, critic_params, mb):
            return completion_values(nnx.merge(self.critic[0], critic_params), mb,
                                     nnx.merge(self.graphdef, params),
                                     self.trips["prompt_group"])

        return _lower(fn, self.params, self.critic[1], self._microbatch())
