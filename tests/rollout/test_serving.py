"""The engine one request at a time (`jaxrl.rollout.serving`, what JetStream's server drives):
a request's tokens equal the RL engine's row with the same key, whatever slot it runs in and
whatever ran there before; stop tokens and the token cap end a slot; the slot count that
fits in memory; the `serve` config section."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ExperimentConfig, load_config, shipped_config
from jaxrl.models import Transformer
from jaxrl.models.config import tiny_config
from jaxrl.rollout import serving, slots
from jaxrl.rollout.decode_loop import EngineConfig, sample_continuous
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.types import SamplerConfig, row_keys

EOS = 2
XLA = slots.PagedAttentionSettings()
QUICKSTART = shipped_config("quickstart.yaml")
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20], [30, 31], [8, 9, 10, 11], [40, 41, 42]]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A server's settings: its slots, longest prompt and completion, and page size."""

    num_slots: int
    max_prefill_length: int
    max_new_tokens: int
    page_size: int

    @property
    def pool(self):
        return serving.pool_layout(self.num_slots, self.max_prefill_length,
                                   self.max_new_tokens, self.page_size)


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny_config("qwen2", vocab_size=48, eos_token_id=EOS), rngs=nnx.Rngs(0))


def _reference(model, prompts, key, sampling, max_new_tokens, stop=(EOS,)):
    """Each prompt's completion from the RL engine (one row per prompt, its own key)."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, True
    config = SamplerConfig(max_new_tokens=max_new_tokens, end_token_ids=stop, sampling=sampling,
                           engine=EngineConfig(max_slots=2))
    out = jax.jit(lambda m: sample_continuous(m, ids, mask, key, config))(model)
    return [[int(t) for t, m in zip(row, rmask, strict=True) if m]
            for row, rmask in zip(out.completion_ids_BxC, out.completion_mask_BxC, strict=True)]


def _serve(model, prompts, keys, sampling, shape, stop=(EOS,)):
    """Every prompt through prefill / insert / generate as a server drives them: a request
    takes the first free slot (a slot is free once it returned an invalid token)."""
    prefill = jax.jit(serving.prefill_request, static_argnums=(4, 5))
    insert = jax.jit(serving.insert_request, static_argnums=(3, 4))
    generate = jax.jit(serving.emit_and_generate, static_argnums=(2, 3, 4, 5))
    stops, layout = slots.Stops(row_ids=tuple(stop)), shape.pool
    state = slots.init(model.config, layout, shape.num_slots)
    pending, owner, outputs = list(range(len(prompts))), {}, {i: [] for i in range(len(prompts))}
    for _ in range(200):
        for slot in range(shape.num_slots):
            if slot not in owner and pending:
                i = pending.pop(0)
                ids_L = np.zeros((shape.max_prefill_length,), np.int32)
                ids_L[:len(prompts[i])] = prompts[i]
                prefix = prefill(model, ids_L, len(prompts[i]), keys[i], sampling,
                                 shape.max_new_tokens)
                state, owner[slot] = insert(state, prefix, slot, layout, stops), i
        if not owner:
            return [outputs[i] for i in range(len(prompts))]
        state, out = generate(model, state, layout, stops, sampling, XLA)
        for slot, i in list(owner.items()):
            if bool(out.valid_S[slot]):
                outputs[i].append(int(out.token_S[slot]))
                assert int(out.index_S[slot]) + 1 == len(outputs[i])
            else:
                del owner[slot]
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("num_slots", [1, 2, 4])
def test_requests_equal_the_rl_engine_rows_in_any_slot(model, num_slots):
    """Sampled at temperature 1 with top-k: the same tokens as the RL engine, with fewer
    slots than requests (slots reused after a request ends)."""
    sampling = SamplingParams(temperature=1.0, top_k=20)
    key = jax.random.key(3)
    # A stop token that some rows draw early (the tiny random model rarely draws its EOS).
    stop = (_reference(model, PROMPTS, key, sampling, 9, stop=())[0][2],)
    want = _reference(model, PROMPTS, key, sampling, max_new_tokens=9, stop=stop)
    layout = Shape(num_slots, max_prefill_length=8, max_new_tokens=9, page_size=4)
    got = _serve(model, PROMPTS, row_keys(key, len(PROMPTS), 1), sampling, layout, stop=stop)
    assert got == want
    assert any(len(w) < 9 for w in want) and any(len(w) == 9 for w in want)  # both endings


def test_greedy_without_stop_tokens_runs_to_the_cap(model):
    sampling = SamplingParams(temperature=0.0)
    layout = Shape(3, max_prefill_length=16, max_new_tokens=5, page_size=16)
    keys = row_keys(jax.random.key(0), len(PROMPTS), 1)
    got = _serve(model, PROMPTS, keys, sampling, layout, stop=())
    assert got == _reference(model, PROMPTS, jax.random.key(0), sampling, 5, stop=())
    assert [len(g) for g in got] == [5] * len(PROMPTS)


def test_a_request_inserted_over_a_live_slot_is_unaffected_by_it(model):
    """JetStream frees a slot as soon as its request has max_tokens tokens, while the engine
    still decodes it: the next request inserted there gets its own tokens, and the pages of
    the one it replaced go back to the free stack."""
    sampling = SamplingParams(temperature=1.0)
    keys = row_keys(jax.random.key(5), 2, 1)
    want = _reference(model, PROMPTS[:2], jax.random.key(5), sampling, 8, stop=())[1]
    layout = Shape(2, max_prefill_length=8, max_new_tokens=8, page_size=4).pool
    stops = slots.Stops()
    state = slots.init(model.config, layout, 2)
    for i, slot in ((0, 0), (1, 0)):  # B over A after 3 steps, with A live
        ids_L = np.zeros((8,), np.int32)
        ids_L[:len(PROMPTS[i])] = PROMPTS[i]
        prefix = serving.prefill_request(model, ids_L, len(PROMPTS[i]), keys[i], sampling, 8)
        state = serving.insert_request(state, prefix, slot, layout, stops)
        got = []
        for _ in range(3 if i == 0 else 9):
            assert i == 1 or bool(state.live_S[0])
            state, out = serving.emit_and_generate(model, state, layout, stops, sampling, XLA)
            if bool(out.valid_S[0]):
                got.append(int(out.token_S[0]))
    assert got == want
    assert int(state.free.count) == layout.row_pages  # every row page free again


def test_a_first_token_that_stops_is_emitted_alone(model):
    """A stop token drawn at prefill is the request's only token."""
    sampling = SamplingParams(temperature=0.0)
    layout = Shape(2, max_prefill_length=8, max_new_tokens=6, page_size=4)
    first = _serve(model, PROMPTS[:1], row_keys(jax.random.key(0), 1, 1), sampling, layout,
                   stop=())[0][0]
    got = _serve(model, PROMPTS[:1], row_keys(jax.random.key(0), 1, 1), sampling, layout,
                 stop=(first,))
    assert got == [[first]]


def test_each_slot_is_a_prompt_home_with_row_pages_for_its_longest_request():
    layout = serving.pool_layout(3, max_prefill_length=10, max_new_tokens=7, page_size=4)
    # A home of 3 pages per slot (10 prompt tokens); a row writes positions n .. n + 5, at
    # most 3 pages of its own (its partial last prompt page copied into the first).
    assert (layout.num_prompts, layout.prompt_pages, layout.row_pages) == (3, 3, 3 * 3)
    assert layout.table_width == 4 and layout.num_pages == 18  # 16 positions, 4 pages
    with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
        serving.pool_layout(0, 10, 7, 4)


def test_slots_that_fit_count_kv_bytes_beside_the_weights():
    config = tiny_config("llama")  # fp32
    per_slot = serving.slot_bytes(config, 12, 5, 4)
    c = config
    # 3 home pages (12 prompt tokens) and 2 own pages (positions n .. n + 3), of 4 tokens.
    assert per_slot == (3 + 2) * 4 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    fit = serving.slots_that_fit(config, memory_bytes=100 * per_slot, weight_bytes=10 * per_slot,
                                 max_prefill_length=12, max_new_tokens=5, page_size=4,
                                 fraction=0.5)
    assert fit == int(0.9 * (50 - 10))  # a tenth of the rest kept for temporaries
    assert serving.slots_that_fit(config, memory_bytes=per_slot, weight_bytes=per_slot,
                                  max_prefill_length=12, max_new_tokens=5, page_size=4,
                                  fraction=0.9) == 0
    huge = serving.slots_that_fit(config, memory_bytes=2**50, weight_bytes=0,
                                  max_prefill_length=12, max_new_tokens=5, page_size=4,
                                  fraction=1.0)
    assert huge == serving.MAX_FIT_SLOTS


def test_serve_section_defaults_and_checks():
    cfg = load_config(ExperimentConfig, QUICKSTART, ["serve.max_prefill_length=100"])
    assert cfg.serve.prefill_buckets() == (16, 32, 64, 100)
    assert load_config(ExperimentConfig, QUICKSTART, []).serve.prefill_buckets()[-1] == 512
    assert load_config(ExperimentConfig, QUICKSTART,
                       ["serve.max_prefill_length=16"]).serve.prefill_buckets() == (16,)
    # Greedy serving of a config that trains at temperature 1 (which training requires > 0).
    greedy = load_config(ExperimentConfig, QUICKSTART, ["serve.sampling.temperature=0"])
    assert greedy.serve.sampling.greedy and greedy.rollout.sampling.temperature > 0


@pytest.mark.parametrize("override, words", [
    ("serve.port=70000", ["serve.port", "70000"]),
    ("serve.max_slots=0", ["serve.max_slots", ">= 1"]),
    ("serve.memory_fraction=1.5", ["serve.memory_fraction", "(0, 1]"]),
    ("serve.max_new_tokens=0", ["serve.max_new_tokens", ">= 1"]),
    ("serve.sampling.temperature=-1", ["serve.sampling.temperature", "-1"]),
])
def test_bad_serve_settings_name_the_key(override, words):
    from jaxrl.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(ExperimentConfig, QUICKSTART, [override])
    for word in words:
        assert word in str(e.value), (word, str(e.value))
