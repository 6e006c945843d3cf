"""jaxrl's engine, driven as a server drives it (`jaxrl.rollout.serving`), as JetStream's `Engine`.

    engine = JetStreamEngine(graphdef, params, spec, mesh=..., rules=...)
    prefix = engine.prefill(params=p, padded_tokens=ids_L, true_length=n)
    state  = engine.insert(prefix, engine.init_decode_state(), slot)
    state, result = engine.generate(p, state)   ResultTokens: [slots, 3] = token, valid, length

Every method is one compiled program (prefill: one per prompt bucket), run on the mesh of
`sharding.layout` under the rollout rules, with the policy cast to its compute dtype once at
load (`place`). The slots and their KV pages are split over the rollout layout's batch axes
(data x fsdp; `jaxrl.rollout.slots_on_mesh`): each device holds its own slots over a pool of
its own, `insert` writes on the device that holds the slot, `generate` decodes every
device's slots on its own pool with no collective over those axes (over `tensor`, the
model's own); a request's prefill runs on every device. When the batch axes do not divide
`num_slots`, one pool is replicated over them. `load_params` reads an HF directory or a
run's checkpoint. The prefill and generate engines of the server are this one object on
the same devices (JetStream's interleaved mode): nothing moves between them, so the
prefix's destination sharding is where prefill left it.

Request i of the engine's life samples with fold_in(key(seed), i) (`jaxrl.rollout.serving`
draws its token t with fold_in of that, t); greedy decoding uses no key.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.config import ExperimentConfig
from jaxrl.models import LoadSettings, ModelConfig, load_policy
from jaxrl.models.paged_attention import resolve_impl
from jaxrl.rollout import serving, slots
from jaxrl.rollout.engine import to_compute_dtype
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.slots_on_mesh import SlotSplit
from jaxrl.saved.files import is_run_dir
from jaxrl.saved.policy import load_run_policy
from jaxrl.serve.jetstream import engine_api, tokenizer_pb2
from jaxrl.serve.tokenizer import HFTokenizer
from jaxrl.sharding import AxisRules, state_shardings, use_rules


def place(params: nnx.State, compute_dtype, mesh: Mesh, rules: AxisRules) -> nnx.State:
    """The parameters cast to the compute dtype (the model casts every weight to it at use
    anyway) and laid out by the rollout rules; arrays already so are kept, not copied."""
    params = to_compute_dtype(params, compute_dtype)
    return jax.device_put(params, state_shardings(params, mesh, rules))


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the engine serves and how: its slots, the longest prompt and completion, the
    pool's page size, sampling, stop tokens, the tokenizer's directory and how it renders
    prompts, the prompt buckets, the attention path, the model's dtypes and the seed of
    request keys."""

    num_slots: int
    max_prefill_length: int
    max_new_tokens: int
    page_size: int
    sampling: SamplingParams
    end_token_ids: tuple[int, ...]  # end a completion: the EOS ids, rollout.stop_token_ids
    tokenizer_dir: str
    chat_template: bool
    buckets: tuple[int, ...]
    attention: str = "auto"
    dtype: str = "float32"
    compute_dtype: str = "float32"
    seed: int = 0

    @classmethod
    def of(cls, cfg: ExperimentConfig, model_config: ModelConfig, *, num_slots: int,
           end_token_ids: tuple[int, ...], tokenizer_dir: str) -> EngineSpec:
        """The spec `jaxrl serve` runs: the `serve` section's limits, sampling, prompts and
        seed; `rollout.engine`'s page size and attention path; the served model's dtypes."""
        serve, engine = cfg.serve, cfg.rollout.engine
        return cls(num_slots=num_slots, max_prefill_length=serve.max_prefill_length,
                   max_new_tokens=serve.max_new_tokens, page_size=engine.page_size,
                   sampling=serve.sampling, end_token_ids=tuple(end_token_ids),
                   tokenizer_dir=tokenizer_dir, chat_template=serve.chat_template,
                   buckets=serve.prefill_buckets(), attention=engine.attention,
                   dtype=model_config.param_dtype, compute_dtype=model_config.compute_dtype,
                   seed=serve.seed)


class JetStreamEngine(engine_api.Engine):
    """JetStream's Engine over `jaxrl.rollout.serving` (module docstring)."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, spec: EngineSpec, *,
                 mesh: Mesh, rules: AxisRules):
        self.graphdef, self.spec, self._mesh, self.rules = graphdef, spec, mesh, rules
        self.model_config = nnx.merge(graphdef, params).config
        self._params = place(params, self.model_config.compute_dtype, mesh, rules)
        self.split = SlotSplit.over(mesh, rules, spec.num_slots)
        # One device's pool: its own slots' homes and row pages.
        self.layout = layout = serving.pool_layout(self.split.local_slots,
                                                   spec.max_prefill_length,
                                                   spec.max_new_tokens, spec.page_size)
        self.attention = slots.PagedAttentionSettings(resolve_impl(
            spec.attention, self.model_config, num_slots=self.split.local_slots,
            num_pages=layout.num_pages, page_size=layout.page_size,
            table_width=layout.table_width))
        self._stops = slots.Stops(row_ids=tuple(spec.end_token_ids))
        self._key = jax.random.key(spec.seed)
        self._requests = itertools.count()
        self._lock = threading.Lock()
        # Every call leaves the state in the split's one layout, so each call's outputs stay
        # where its donated inputs were and no call moves the pool; a prefix is on every
        # device, and the tokens generate emits stay on the devices of their slots.
        state = self.split.shardings(jax.eval_shape(self._init_traced))
        everywhere = NamedSharding(mesh, P())
        by_slot = NamedSharding(mesh, P(self.split.axes or None))
        self._prefill = jax.jit(self._prefill_traced, out_shardings=everywhere)
        self._insert = jax.jit(self._insert_traced, donate_argnums=1, out_shardings=state)
        self._generate = jax.jit(self._generate_traced, donate_argnums=1,
                                 out_shardings=(state, by_slot))
        self._init = jax.jit(self._init_traced, out_shardings=state)

    # -- parameters ------------------------------------------------------------------------

    def load_params(self, source: str | Path | None = None, *,
                    step: int | None = None) -> nnx.State:
        """The policy's parameters in the rollout layout and compute dtype: those the engine
        was made with (no `source`), an HF model directory's, or checkpoint `step` (default:
        the newest) of a run directory's."""
        if source is None:
            return self._params
        source = Path(source)
        if is_run_dir(source):
            _, model, _ = load_run_policy(source, step)
            params = nnx.state(model)
        else:
            params = nnx.state(load_policy(source, LoadSettings(
                dtype=self.spec.dtype, compute_dtype=self.spec.compute_dtype)))
        return place(params, self.model_config.compute_dtype, self._mesh, self.rules)

    # -- the four calls ----------------------------------------------------------------------

    def prefill(self, *, params: nnx.State, existing_prefix: serving.Request | None = None,
                padded_tokens: jax.Array, true_length: int) -> serving.Request:
        if existing_prefix is not None:
            raise NotImplementedError("jaxrl's engine does not extend an existing prefix "
                                      "(no session cache); send the whole prompt")
        with self._lock:
            request = next(self._requests)
        key = jax.random.fold_in(self._key, request)
        return self._prefill(params, jnp.asarray(padded_tokens, jnp.int32),
                             jnp.int32(true_length), key)

    def insert(self, prefix: serving.Request, decode_state: slots.SlotState,
               slot: int) -> slots.SlotState:
        return self._insert(prefix, decode_state, jnp.int32(slot))

    def generate(self, params: nnx.State, decode_state: slots.SlotState
                 ) -> tuple[slots.SlotState, engine_api.ResultTokens]:
        state, data_Sx3 = self._generate(params, decode_state)
        return state, engine_api.ResultTokens(data_Sx3, tokens_idx=(0, 1), valid_idx=(1, 2),
                                              length_idx=(2, 3), samples_per_slot=1)

    def init_decode_state(self) -> slots.SlotState:
        return self._init()

    # -- compiled bodies ---------------------------------------------------------------------

    def _model(self, params):
        return nnx.merge(self.graphdef, params)

    def _prefill_traced(self, params, ids_L, length, key):
        with use_rules(self._mesh, self.rules):
            return serving.prefill_request(self._model(params), ids_L, length, key,
                                           self.spec.sampling, self.spec.max_new_tokens)

    def _insert_traced(self, prefix, state, slot):
        return self.split.on_owner(
            lambda state, slot, prefix: serving.insert_request(state, prefix, slot, self.layout,
                                                               self._stops), state, slot, prefix)

    def _generate_traced(self, params, state):
        state, sent = self.split.on_each(
            lambda state, params: serving.emit_and_generate(
                self._model(params), state, self.layout, self._stops, self.spec.sampling,
                self.attention), state, params)
        data_Sx3 = jnp.stack([sent.token_S, sent.valid_S.astype(jnp.int32), sent.index_S + 1],
                             axis=1)
        return state, data_Sx3

    def _init_traced(self):
        return self.split.init(self.model_config, self.layout)

    # -- what the orchestrator asks ----------------------------------------------------------

    def warmup(self) -> None:
        """Compiles every program (each prefill bucket, insert, generate) on throwaway data."""
        state = self.init_decode_state()
        for width in self.spec.buckets:
            prefix = self._prefill(self._params, jnp.zeros((width,), jnp.int32), jnp.int32(1),
                                   self._key)
            state = self.insert(prefix, state, 0)
        state, result = self.generate(self._params, state)
        jax.block_until_ready(result.data)

    @functools.cached_property
    def _prefix_shape(self):
        width = self.spec.buckets[0]
        return jax.eval_shape(self._prefill_traced, self._params,
                              jax.ShapeDtypeStruct((width,), jnp.int32),
                              jax.ShapeDtypeStruct((), jnp.int32), self._key)

    def get_prefix_destination_sharding(self) -> serving.Request:
        replicated = NamedSharding(self._mesh, P())
        return jax.tree.map(lambda _: replicated, self._prefix_shape)

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self.spec.tokenizer_dir)

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> HFTokenizer:
        return HFTokenizer(metadata.path, chat_template=self.spec.chat_template,
                           stop_ids=self.spec.end_token_ids, buckets=self.spec.buckets)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.spec.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.spec.max_prefill_length

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None  # no host-offloaded work
