"""jaxrl's engine against JetStream's abstract Engine API: it is an `Engine`, defines every
abstract method itself, and each returns JetStream's types with the shapes the orchestrator
reads; driven as the orchestrator drives it, it gives `jaxrl generate`'s greedy text, also
with its slots split over the devices; `load_params` reads an HF directory and a run's
checkpoint."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models import from_pretrained
from jaxrl.rollout import serving
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.saved.checkpoint import Checkpoints
from jaxrl.serve.engine import EngineSpec, JetStreamEngine
from jaxrl.serve.jetstream import engine_api, tokenizer_api, tokenizer_pb2
from jaxrl.sharding import make_mesh, resolve_layout
from tests.serve.conftest import PROMPTS, generate_greedy

SLOTS, PREFILL, NEW = 3, 32, 10


def make_engine(model_dir, *, layout="fsdp_tp", slots=SLOTS, stop=(2,)):
    preset = resolve_layout(layout)
    mesh = make_mesh(preset)
    model = from_pretrained(model_dir, mesh=mesh, rules=preset.rollout_rules)
    graphdef, params = nnx.split(model)
    spec = EngineSpec(num_slots=slots, max_prefill_length=PREFILL, max_new_tokens=NEW, page_size=4,
                      sampling=SamplingParams(temperature=0.0), end_token_ids=stop,
                      tokenizer_dir=str(model_dir), chat_template=True, buckets=(16, PREFILL))
    return JetStreamEngine(graphdef, params, spec, mesh=mesh, rules=preset.rollout_rules)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


def test_it_is_a_jetstream_engine_defining_every_abstract_method(engine):
    assert isinstance(engine, engine_api.Engine)
    abstract = engine_api.Engine.__abstractmethods__
    assert {"prefill", "insert", "generate", "load_params", "init_decode_state",
            "get_prefix_destination_sharding", "get_tokenizer", "max_concurrent_decodes",
            "samples_per_slot", "max_prefill_length", "mesh", "colocated_cpus"} <= abstract
    for name in abstract | {"build_tokenizer"}:
        assert name in vars(JetStreamEngine), name  # ours, not the ABC's default
    assert engine.max_concurrent_decodes == SLOTS and engine.samples_per_slot == 1
    assert engine.max_prefill_length == PREFILL and isinstance(engine.mesh, Mesh)
    assert engine.colocated_cpus is None


def test_tokenizer_is_jetstreams_and_pads_to_buckets(engine):
    params = engine.get_tokenizer()
    assert isinstance(params, tokenizer_pb2.TokenizerParameters)
    tokenizer = engine.build_tokenizer(params)
    assert isinstance(tokenizer, tokenizer_api.Tokenizer)
    ids, n = tokenizer.encode("hello")
    assert ids.shape == (16,) and ids.dtype == np.int32 and n == len(tokenizer.ids("hello"))
    assert (ids[n:] == tokenizer.pad_id).all()
    ids, n = tokenizer.encode("a" * 20)
    assert ids.shape == (PREFILL,) and n >= 20
    assert tokenizer.decode([int(t) for t in ids[:n]]).endswith("a" * 20)
    assert tokenizer.stop_tokens == {2}
    with pytest.raises(ValueError, match=f"serve.max_prefill_length {PREFILL}"):
        tokenizer.encode("b" * 40)


def _drive(engine, params, prompts, max_tokens):
    """The orchestrator's loop, in one thread: insert into free slots, generate, read each
    slot's ResultTokens until its request completes (JetStream's own `process_result_tokens`)."""
    from jetstream.engine.token_utils import process_result_tokens

    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    state = engine.init_decode_state()
    pending, live = list(prompts), {}
    out = {p: [] for p in prompts}
    for _ in range(500):
        for slot in range(engine.max_concurrent_decodes):
            if slot not in live and pending:
                prompt = pending.pop(0)
                ids, n = tokenizer.encode(prompt)
                prefix = engine.prefill(params=params, padded_tokens=ids, true_length=n)
                prefix = jax.device_put(prefix, engine.get_prefix_destination_sharding())
                state = engine.insert(prefix, state, slot)
                live[slot] = (prompt, np.zeros((1,), bool))
        if not live:
            return out
        state, result = engine.generate(params, state)
        assert isinstance(result, engine_api.ResultTokens) and result.samples_per_slot == 1
        assert result.data.shape == (engine.max_concurrent_decodes, 3)
        assert result.data.dtype == np.int32
        result = result.convert_to_numpy()
        for slot, (prompt, complete) in list(live.items()):
            data = result.get_result_at_slot(slot)
            assert data.tokens.shape == (1, 1) and data.lengths.shape == (1,)
            samples, complete = process_result_tokens(tokenizer, slot, max_tokens, result,
                                                      complete)
            out[prompt] += samples[0].token_ids
            live[slot] = (prompt, complete)
            if complete.all():
                del live[slot]
    raise AssertionError("requests did not complete")


def test_driven_like_the_orchestrator_it_gives_generates_greedy_text(engine, model_dir):
    params = engine.load_params()
    got = _drive(engine, params, PROMPTS, NEW)
    want = generate_greedy(model_dir, PROMPTS, NEW)
    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    for prompt in PROMPTS:
        assert tokenizer.decode(got[prompt]) == want[prompt][0], prompt
    assert len({tuple(v) for v in got.values()}) > 1  # prompts get different completions


def test_on_a_mesh_each_device_serves_its_own_slots_with_the_same_text(model_dir):
    """dp_fsdp_tp on the 8 devices: 4 slots, one per device of data x fsdp (KV heads over
    tensor); a device holds its own slot's pages only; 8 requests over them give
    `jaxrl generate`'s greedy text."""
    engine = make_engine(model_dir, layout="dp_fsdp_tp", slots=4)
    assert engine.split.describe() == "1 per device over data x fsdp (4 devices)"
    state = engine.init_decode_state()
    pages = state.kv_pages.shape[1]
    assert pages == 4 * engine.layout.num_pages
    assert state.kv_pages.sharding.shard_shape(state.kv_pages.shape)[1] == pages // 4
    assert state.row_S.sharding.shard_shape(state.row_S.shape) == (1,)
    got = _drive(engine, engine.load_params(), PROMPTS, NEW)
    want = generate_greedy(model_dir, PROMPTS, NEW)
    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    for prompt in PROMPTS:
        assert tokenizer.decode(got[prompt]) == want[prompt][0], prompt


def test_prefix_and_decode_state_shapes(engine):
    params = engine.load_params()
    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    ids, n = tokenizer.encode("abc")
    prefix = engine.prefill(params=params, padded_tokens=ids, true_length=n)
    c = engine.model_config
    kv, request = prefix
    assert kv.kv_LxPxLx2KxH.shape == (c.num_layers, 1, 16, 2 * c.num_kv_heads, c.head_dim)
    assert int(kv.length_P[0]) == n and int(request.length_S[0]) == n
    state = engine.insert(prefix, engine.init_decode_state(), 2)
    assert state.live_S.tolist() == [False, False, True]
    assert state.kv_pages.shape[1] == serving.pool_layout(SLOTS, PREFILL, NEW, 4).num_pages
    with pytest.raises(NotImplementedError, match="existing prefix"):
        engine.prefill(params=params, existing_prefix=prefix, padded_tokens=ids, true_length=n)


def test_load_params_from_an_hf_directory_and_a_run_checkpoint(engine, model_dir, trained_run):
    hf = engine.load_params(model_dir)
    for a, b in zip(jax.tree.leaves(hf), jax.tree.leaves(engine.load_params()), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    run_engine = make_engine(trained_run / "init_model")
    policy = from_pretrained(trained_run / "init_model")
    for step in (1, 2):
        _, want = Checkpoints(trained_run).restore_model(nnx.state(policy), step)
        got = run_engine.load_params(trained_run, step=step)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    initial = run_engine.load_params()
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(initial), jax.tree.leaves(got), strict=True))  # training changed them
