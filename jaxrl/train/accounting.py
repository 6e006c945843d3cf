"""FLOP accounting of the RL step: each phase compiled as a loop-free program, counted by XLA.

    prefill       sampler.prefill of the P prompts                       x 1
    decode        sampler.decode_step + sample_rows of the B = P·G rows  x decode steps run
    logprobs      completion_log_probs of one microbatch (old / ref)     x microbatches x (1 + KL)
    grad          value_and_grad(microbatch_loss) of one microbatch      x iterations x minibatches
                                                                            x microbatches
    update        the optimizer update                                   x iterations x minibatches

These are the functions the step program runs (`jaxrl.rollout.sampler`, `jaxrl.train.phases`),
compiled on abstract inputs of the step's shapes with the layers unrolled and the
vocabulary-chunk loop unrolled, so XLA's cost analysis sees every FLOP once
(`jaxrl.perf.flops` explains why loops must go). Two sets are compiled:

    model      remat off, whole-vocabulary log-probs, one device with the global shapes:
               the work the step needs, whatever the layout          -> perf/model_flops, MFU
    hardware   remat and log-prob chunking as configured, sharded as the run (per-device
               FLOPs x devices): the work the devices execute         -> perf/xla_flops, HFU

When the two would be the same program (one device, no remat, no chunking) it is compiled
once. Not counted: the reward, advantage and masking arithmetic (O(B·C) elementwise), and the
sampling of the first token after prefill; the analytic count (`jaxrl.perf.analytic`) is
computed beside both as a cross-check.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models import KVCache, ModelConfig, Transformer
from jaxrl.models.transformer import CACHE_AXES
from jaxrl.perf import analytic
from jaxrl.perf.flops import PhaseCount, ProgramCost, StepFlops, program_cost
from jaxrl.rollout.sampler import SamplerConfig, decode_step, prefill, sample_rows
from jaxrl.sharding import AxisRules, state_shardings, use_rules
from jaxrl.train.phases import StepConfig, completion_log_probs, microbatch_loss
from jaxrl.train.state import TrainState


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
    """Model, hardware (XLA) and analytic FLOPs of a step; `decode_steps` is
    `rollout/num_steps - 1` of that step."""

    model: StepFlops
    hardware: StepFlops
    analytic: StepFlops

    def metrics(self, decode_steps: int) -> dict[str, float | None]:
        return {"perf/model_flops": self.model.total(decode_steps),
                "perf/xla_flops": self.hardware.total(decode_steps),
                "perf/analytic_flops": self.analytic.total(decode_steps)}


def account_step(algo: StepConfig, model_config: ModelConfig, sampler: SamplerConfig,
                 shapes: StepShapes, ts_graphdef: nnx.GraphDef, ts_state: nnx.State, *,
                 mesh: Mesh, rollout_rules: AxisRules, train_rules: AxisRules,
                 ) -> StepAccounting:
    """Compiles the phase programs (module docstring) and counts them; `ts_state` (the train
    state, concrete or abstract) gives the optimizer update's shapes and shardings."""
    trips = _trips(algo, shapes)
    model = _Phases(algo, model_config, sampler, shapes, ts_graphdef, ts_state, trips,
                    remat="none", chunk_size=None, mesh=None)
    same = mesh.size == 1 and model_config.remat == "none" and algo.logprob_chunk_size is None
    variants = [model] if same else [model, _Phases(
        algo, model_config, sampler, shapes, ts_graphdef, ts_state, trips,
        remat=model_config.remat, chunk_size=algo.logprob_chunk_size, mesh=mesh,
        rollout_rules=rollout_rules, train_rules=train_rules)]
    # Tracing is sequential; XLA compiles without the GIL, so the programs compile in
    # parallel (the programs of a step are independent).
    lowered = [v.lower() for v in variants]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = [{name: pool.submit(low.compile) for name, low in programs.items()}
                   for programs in lowered]
        counted = [v.count({name: f.result() for name, f in programs.items()})
                   for v, programs in zip(variants, futures, strict=True)]
    return StepAccounting(counted[0], counted[-1], _analytic(model_config, shapes, trips))


def _trips(algo: StepConfig, shapes: StepShapes) -> dict[str, int]:
    minibatch, num_micro = algo.batch_split(shapes.rows)
    updates = algo.num_iterations * algo.num_minibatches
    return {"micro_rows": minibatch // num_micro,
            "logprobs": shapes.rows // (minibatch // num_micro) * (1 + (algo.loss.beta > 0)),
            "grad": updates * num_micro, "update": updates}


def _analytic(config: ModelConfig, shapes: StepShapes, trips: dict[str, int]) -> StepFlops:
    p, c, b = shapes.prompt_len, shapes.max_new_tokens, trips["micro_rows"]

    def phase(name, flops, n, per_decode_step=False):
        return PhaseCount(ProgramCost(name, flops, None, "analytic"), n, per_decode_step)

    return StepFlops(
        generate=(phase("prefill", analytic.prefill_flops(config, shapes.prompts, p, c), 1),
                  phase("decode", analytic.decode_step_flops(config, shapes.rows, p, c), 0,
                        per_decode_step=True)),
        train=(phase("logprobs", analytic.logprob_flops(config, b, p, c), trips["logprobs"]),
               phase("grad", analytic.grad_flops(config, b, p, c), trips["grad"])))


class _Phases:
    """The phase programs of one variant (model or hardware) on abstract inputs."""

    def __init__(self, algo: StepConfig, model_config: ModelConfig, sampler: SamplerConfig,
                 shapes: StepShapes, ts_graphdef: nnx.GraphDef, ts_state: nnx.State,
                 trips: dict[str, int], *, remat: str, chunk_size: int | None,
                 mesh: Mesh | None, rollout_rules: AxisRules | None = None,
                 train_rules: AxisRules | None = None):
        self.algo = dataclasses.replace(algo, logprob_chunk_size=chunk_size)
        self.sampler, self.shapes, self.trips = sampler, shapes, trips
        self.mesh, self.rollout_rules, self.train_rules = mesh, rollout_rules, train_rules
        config = dataclasses.replace(model_config, scan_layers=False, remat=remat)
        self.graphdef, self.params = nnx.split(
            nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
        self.config = config
        self.ts_graphdef = ts_graphdef
        self.ts_state = jax.tree.map(lambda x: self._abstract(x.shape, x.dtype, x), ts_state)

    def lower(self) -> dict[str, jax.stages.Lowered]:
        """The phase programs, traced and lowered (not yet compiled)."""
        return {"prefill": self._prefill(), "decode": self._decode(),
                "logprobs": self._logprobs(), "grad": self._grad(), "update": self._update()}

    def count(self, compiled: dict[str, jax.stages.Compiled]) -> StepFlops:
        """The step's FLOPs from the compiled phase programs and their trip counts."""
        devices = 1 if self.mesh is None else self.mesh.size
        cost = {name: program_cost(name, c, devices) for name, c in compiled.items()}
        t = self.trips
        return StepFlops(
            generate=(PhaseCount(cost["prefill"], 1),
                      PhaseCount(cost["decode"], 0, per_decode_step=True)),
            train=(PhaseCount(cost["logprobs"], t["logprobs"]),
                   PhaseCount(cost["grad"], t["grad"]),
                   PhaseCount(cost["update"], t["update"])))

    # ------------------------------------------------------------------ abstract inputs

    def _abstract(self, shape, dtype, like: Any = None, axes=None, rules=None):
        """A ShapeDtypeStruct, placed like `like` (an array) or by logical `axes` on a mesh."""
        if self.mesh is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        sharding = getattr(like, "sharding", None) if axes is None else rules.sharding(
            axes, shape, self.mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _params(self, rules):
        if self.mesh is None:
            return self.params
        shardings = state_shardings(self.params, self.mesh, rules)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.params, shardings)

    def _rows(self, rules, rows, *tail, dtype=jnp.int32):
        return self._abstract((rows, *tail), dtype, axes=("batch",) + (None,) * len(tail),
                              rules=rules)

    def _lower(self, fn, rules, *args) -> jax.stages.Lowered:
        def body(*a):
            scope = (contextlib.nullcontext() if self.mesh is None
                     else use_rules(self.mesh, rules))
            with scope:
                return fn(*a)

        return jax.jit(body).lower(*args)

    # ------------------------------------------------------------------ the programs

    def _prefill(self) -> jax.stages.Lowered:
        s, rules = self.shapes, self.rollout_rules

        def fn(params, ids_BxP, mask_BxP):
            return prefill(nnx.merge(self.graphdef, params), ids_BxP, mask_BxP,
                           s.max_new_tokens)

        return self._lower(fn, rules, self._params(rules),
                             self._rows(rules, s.prompts, s.prompt_len),
                             self._rows(rules, s.prompts, s.prompt_len, dtype=jnp.bool_))

    def _decode(self) -> jax.stages.Lowered:
        s, rules, cfg = self.shapes, self.rollout_rules, self.config
        slots = s.prompt_len + s.max_new_tokens - 1
        kv_shape = (cfg.num_layers, s.rows, slots, cfg.num_kv_heads, cfg.head_dim)
        kv = self._abstract(kv_shape, cfg.compute_dtype, axes=CACHE_AXES, rules=rules)
        cache = KVCache(kv, kv, self._rows(rules, s.rows, slots, dtype=jnp.bool_),
                        jax.ShapeDtypeStruct((), jnp.int32))

        def fn(params, token_B, position_B, cache, key_data_Bx2, t):
            logits_BxV, cache = decode_step(nnx.merge(self.graphdef, params), token_B,
                                            position_B, cache)
            keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
                jax.random.wrap_key_data(key_data_Bx2), t)
            return sample_rows(keys_B, logits_BxV, self.sampler.sampling), cache

        return self._lower(fn, rules, self._params(rules),
                             self._rows(rules, s.rows), self._rows(rules, s.rows), cache,
                             self._rows(rules, s.rows, 2, dtype=jnp.uint32),
                             jax.ShapeDtypeStruct((), jnp.int32))

    def _microbatch(self, rules) -> dict[str, Any]:
        s, b = self.shapes, self.trips["micro_rows"]
        t, c = s.prompt_len + s.max_new_tokens, s.max_new_tokens
        mb = {"ids_BxT": self._rows(rules, b, t), "mask_BxT": self._rows(rules, b, t, dtype=bool),
              "loss_mask_BxC": self._rows(rules, b, c, dtype=bool),
              "adv_B": self._rows(rules, b, dtype=jnp.float32),
              "old_logp_BxC": self._rows(rules, b, c, dtype=jnp.float32)}
        if self.algo.loss.beta > 0:
            mb["ref_logp_BxC"] = self._rows(rules, b, c, dtype=jnp.float32)
        if self.algo.loss.tis_cap is not None:
            mb["sampler_logp_BxC"] = self._rows(rules, b, c, dtype=jnp.float32)
        return mb

    def _logprobs(self) -> jax.stages.Lowered:
        rules, algo = self.train_rules, self.algo

        def fn(params, mb):
            return completion_log_probs(nnx.merge(self.graphdef, params), mb, algo.temperature,
                                        algo.logprob_chunk_size, unroll=True)[0]

        return self._lower(fn, rules, self._params(rules), self._microbatch(rules))

    def _grad(self) -> jax.stages.Lowered:
        rules, algo = self.train_rules, self.algo
        count = jax.ShapeDtypeStruct((), jnp.int32)

        def fn(params, mb, num_tokens, num_seqs):
            def loss(model):
                return microbatch_loss(algo, model, mb, num_tokens, num_seqs, unroll=True)

            return nnx.value_and_grad(loss, has_aux=True)(nnx.merge(self.graphdef, params))

        return self._lower(fn, rules, self._params(rules), self._microbatch(rules),
                             count, count)

    def _update(self) -> jax.stages.Lowered:
        ts_abstract = nnx.merge(self.ts_graphdef, self.ts_state)
        grads = nnx.state(ts_abstract.model, nnx.Param)

        def fn(state, grads):
            ts: TrainState = nnx.merge(self.ts_graphdef, state)
            ts.apply_gradients(grads)
            return nnx.state(ts)

        return self._lower(fn, self.train_rules, self.ts_state, grads)
