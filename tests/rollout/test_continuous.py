"""The paged, continuous-batching engine: row for row the reference sampler's rollout, under
either batching and any slot count; per-row limits; pages given back and reused."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams
from jaxrl.rollout import slots as ops
from jaxrl.rollout.decode_loop import (
    EngineConfig,
    advance,
    begin,
    decode_setup,
    rollout,
)
from jaxrl.rollout.pages import PoolLayout, worst_row_pages
from jaxrl.rollout.slot_count import max_concurrent_decodes, tail_min_slots
from jaxrl.rollout.types import prompt_keys
from tests.rollout.test_sampler import (
    GROUP,
    LLAMA,
    NEW_TOKENS,
    PROMPT_LENGTHS,
    greedy_rollout,
    max_masked_diff,
    policy,
    prompts,
    t07_rollout,
    trainer_log_probs,
)

ROWS = len(PROMPT_LENGTHS) * GROUP


@functools.cache
def engine_sampler(temperature, slots, batching="continuous", page_size=4, row_pages=None,
                   stop=(), max_new=NEW_TOKENS, min_slots=None):
    engine = EngineConfig(max_slots=slots, page_size=page_size, batching=batching,
                          row_pages=row_pages, pages_per_block=2, min_slots=min_slots)
    config = SamplerConfig(max_new, GROUP, end_token_ids=stop,
                           sampling=SamplingParams(temperature), engine=engine)
    return Sampler(policy(*LLAMA)[0], config)


def engine_rollout(temperature, slots, seed=0, **kw):
    return engine_sampler(temperature, slots, **kw).generate(
        policy(*LLAMA)[1], prompts(), jax.random.key(seed))


def assert_same_rows(a, b, atol):
    np.testing.assert_array_equal(a.completion_ids_BxC, b.completion_ids_BxC)
    np.testing.assert_array_equal(a.completion_mask_BxC, b.completion_mask_BxC)
    np.testing.assert_array_equal(a.prompt_ids_BxP, b.prompt_ids_BxP)
    np.testing.assert_allclose(a.logp_BxC, b.logp_BxC, atol=atol, rtol=0)
    np.testing.assert_allclose(a.logp_raw_BxC, b.logp_raw_BxC, atol=atol, rtol=0)


@pytest.mark.parametrize("slots", [ROWS, 3, 1])
def test_engine_matches_the_reference_sampler(slots):
    """Greedy and T=0.7: the tokens of the dense static sampler, log-probs to fp32 roundoff
    (paged online softmax vs one softmax over the whole cache)."""
    assert_same_rows(engine_rollout(0.0, slots), greedy_rollout(), atol=1e-5)
    assert_same_rows(engine_rollout(0.7, slots), t07_rollout(0), atol=1e-5)


def test_engine_log_probs_match_trainer_forward():
    rollout_ = engine_rollout(0.7, 3)
    logp, logp_raw = trainer_log_probs(rollout_, *LLAMA)
    mask = np.asarray(rollout_.completion_mask_BxC)
    assert max_masked_diff(rollout_.logp_BxC, logp, mask) <= 1e-5
    assert max_masked_diff(rollout_.logp_raw_BxC, logp_raw, mask) <= 1e-5


def _stop_ids_with_varied_lengths():
    """Stop ids at which the T=0.7 rows end at several different lengths."""
    tokens = np.asarray(t07_rollout(0).completion_ids_BxC)
    for token in np.unique(tokens):
        first = np.where((tokens == token).any(1), (tokens == token).argmax(1), NEW_TOKENS)
        if len(np.unique(first)) >= 3 and (first < NEW_TOKENS - 1).sum() >= 3:
            return (int(token),)
    raise AssertionError("no token ends the rows at varied lengths")


# (slots, batching, min_slots) against static batching over every row. Every variant at
# page size 4; at the page sizes 1 (a page per token) and 16 (a row in one page) the variants
# that reuse slots and pages mid-rollout: each variant or page size compiles an engine program.
VARIANTS = [(ROWS, "continuous", None), (3, "continuous", None), (3, "static", None),
            (1, "continuous", None), (ROWS, "continuous", 2), (6, "continuous", 3)]
REUSING = [(3, "continuous", None), (6, "continuous", 3)]


@pytest.mark.parametrize("page_size, variants", [(1, REUSING), (4, VARIANTS), (16, REUSING)])
def test_static_and_continuous_batching_give_every_row_the_same_tokens(page_size, variants):
    """EOS at varied lengths, prompts of varied lengths: any slot count, either batching,
    tokens bit-equal and log-probs within 1e-6."""
    stop = _stop_ids_with_varied_lengths()
    base = engine_rollout(0.7, ROWS, batching="static", page_size=page_size, stop=stop)
    lengths = np.asarray(base.completion_mask_BxC).sum(1)
    assert len(np.unique(lengths)) >= 3, lengths
    for slots, batching, min_slots in variants:
        other = engine_rollout(0.7, slots, batching=batching, page_size=page_size, stop=stop,
                               min_slots=min_slots)
        assert_same_rows(other, base, atol=1e-6)


def _loop_counts(limits, slots, min_slots):
    """(iterations, slot steps) of `rollout` with per-row `limits` (T=0.7, no stop ids)."""
    graphdef, state = policy(*LLAMA)
    ids, mask = prompts()
    engine = EngineConfig(max_slots=slots, page_size=4, min_slots=min_slots)
    keys = jax.random.split(jax.random.key(0), ROWS)
    _, steps, slot_steps = jax.jit(lambda state: rollout(
        nnx.merge(graphdef, state), ids, mask, keys, jnp.asarray(limits, jnp.int32),
        NEW_TOKENS, engine, end_token_ids=(), pad_token_id=0,
        sampling=SamplingParams(0.7)))(state)
    return int(steps), int(slot_steps)


def test_slots_halve_for_the_tail():
    """One long row among short ones: after the first iteration only it lives, so it moves
    8 -> 4 -> 2 slots and its 6 other iterations run 2 slots each (a row with limit l is
    live for l - 1 iterations: its first token comes from the prefill)."""
    limits = [8] + [2] * (ROWS - 1)
    assert _loop_counts(limits, ROWS, None) == (7, 7 * ROWS)
    assert _loop_counts(limits, ROWS, 2) == (7, ROWS + 6 * 2)
    assert _loop_counts(limits, ROWS, 4) == (7, ROWS + 6 * 4)
    with pytest.raises(ValueError, match="min_slots"):
        EngineConfig(batching="static", min_slots=2)


def test_per_row_limits_truncate_each_row():
    """Row r with limit l_r: the first l_r tokens of the unlimited row, then padding."""
    graphdef, state = policy(*LLAMA)
    limits = jnp.asarray([1, 8, 3, 5, 2, 8, 4, 6], jnp.int32)
    config = SamplerConfig(NEW_TOKENS, GROUP, sampling=SamplingParams(0.7),
                           engine=EngineConfig(max_slots=3, page_size=4, pages_per_block=2))

    @jax.jit
    def run(state, ids, mask, key, limits):
        from jaxrl.rollout.decode_loop import sample_continuous
        return sample_continuous(nnx.merge(graphdef, state), ids, mask, key, config, limits)

    limited = run(state, *prompts(), jax.random.key(0), limits)
    full = t07_rollout(0)
    mask_BxC = np.arange(NEW_TOKENS)[None, :] < np.asarray(limits)[:, None]
    np.testing.assert_array_equal(limited.completion_mask_BxC, mask_BxC)
    np.testing.assert_array_equal(limited.completion_ids_BxC,
                                  np.where(mask_BxC, full.completion_ids_BxC, 0))
    np.testing.assert_allclose(limited.logp_BxC, np.where(mask_BxC, full.logp_BxC, 0),
                               atol=1e-5)


def test_pages_are_given_back_and_reused():
    """A pool with room for one row at a time: rows wait for pages, every row still gets
    its tokens, and at the end every row page is free again."""
    worst = worst_row_pages(max(PROMPT_LENGTHS), NEW_TOKENS, 4)
    tight = engine_rollout(0.7, 3, row_pages=worst)
    assert_same_rows(tight, t07_rollout(0), atol=1e-5)

    graphdef, state = policy(*LLAMA)
    ids, mask = prompts()
    engine = EngineConfig(max_slots=3, page_size=4, row_pages=worst)
    keys = jax.vmap(lambda k: jax.random.split(k, GROUP))(
        prompt_keys(jax.random.key(0), len(PROMPT_LENGTHS))).reshape(-1)

    @jax.jit
    def run(state):
        model = nnx.merge(graphdef, state)
        setup = decode_setup(model.config, engine, len(PROMPT_LENGTHS), ids.shape[1], ROWS,
                             NEW_TOKENS, (), SamplingParams(0.7))
        progress = advance(model, setup, begin(
            model, setup, ids, mask, keys, jnp.full((ROWS,), NEW_TOKENS, jnp.int32),
            NEW_TOKENS, 0), keys)
        final = progress.state
        return final.free.count, jnp.sort(final.free.ids_F), final.row_S, progress.steps

    count, ids_sorted, row_S, steps = run(state)
    layout = PoolLayout.plan(page_size=4, num_prompts=len(PROMPT_LENGTHS),
                             prompt_len=max(PROMPT_LENGTHS), max_new_tokens=NEW_TOKENS,
                             num_slots=3, row_pages=worst)
    first = layout.num_prompts * layout.prompt_pages
    assert int(count) == worst
    np.testing.assert_array_equal(ids_sorted, first + np.arange(worst))
    np.testing.assert_array_equal(row_S, -1)
    # Any two rows need more than `worst` pages, so one runs at a time: 8 rows x 7 steps.
    assert int(steps) == ROWS * (NEW_TOKENS - 1)


def test_the_engine_steps_by_hand_give_the_rollout_row():
    """JetStream's loop by hand: prefill the prompts (one sample each), insert row 2 into slot
    1 of 2, generate until its limit: the tokens `rollout` gives row 2; slot 0 stays free."""
    graphdef, state = policy(*LLAMA)
    ids, mask = prompts()
    num_prompts = ids.shape[0]
    keys = jax.random.split(jax.random.key(3), num_prompts)
    limit = jnp.full((num_prompts,), NEW_TOKENS, jnp.int32)
    sampling = SamplingParams(0.7)
    engine = EngineConfig(max_slots=2, page_size=4, attention="xla")
    num_slots = max_concurrent_decodes(engine, num_prompts)
    layout = PoolLayout.plan(page_size=4, num_prompts=num_prompts, prompt_len=ids.shape[1],
                             max_new_tokens=NEW_TOKENS, num_slots=num_slots)

    @jax.jit
    def by_hand(state):
        model = nnx.merge(graphdef, state)
        st = ops.init(model.config, layout, num_slots)
        prefix = ops.prefill(model, ids, mask)
        st = ops.write_prompts(st, layout, prefix.kv_LxPxLx2KxH, prefix.length_P,
                                 jnp.arange(num_prompts))
        key_data = jax.random.key_data(keys)
        first, logp, logp_raw = ops.first_tokens(prefix.logits_PxV, key_data, sampling)
        on_1 = jnp.asarray([0, 2])  # slot 0 takes nothing; slot 1 row 2
        st = ops.insert(st, layout, ops.Starts(
            jnp.asarray([-1, 2]), on_1, prefix.length_P[on_1], first[on_1], logp[on_1],
            logp_raw[on_1], key_data[on_1], limit[on_1]), ops.Stops())
        tokens = [first[2]]
        for _ in range(NEW_TOKENS - 1):
            st, drawn = ops.generate(model, st, layout, engine.read, ops.Stops(), sampling)
            tokens.append(drawn.token_S[1])
        return jnp.stack(tokens), drawn.row_S[0], st.row_S

    @jax.jit
    def whole(state):
        return rollout(nnx.merge(graphdef, state), ids, mask, keys, limit, NEW_TOKENS, engine,
                       end_token_ids=(), pad_token_id=0, sampling=sampling)[0].tokens_BxC

    tokens, free_row, row_S = by_hand(state)
    assert num_slots == 2
    np.testing.assert_array_equal(tokens, whole(state)[2])
    assert int(free_row) == -1  # slot 0 drew nothing
    np.testing.assert_array_equal(row_S, [-1, -1])  # the row ended at its limit


def test_a_page_is_no_longer_than_the_longest_row():
    """6 prompt + 4 new tokens: the cache holds at most 9, so pages of 16 become pages of 9."""
    layout = PoolLayout.plan(page_size=16, num_prompts=2, prompt_len=6, max_new_tokens=4,
                             num_slots=4)
    assert (layout.page_size, layout.table_width, layout.prompt_pages) == (9, 1, 1)
    assert PoolLayout.plan(page_size=4, num_prompts=2, prompt_len=6, max_new_tokens=4,
                           num_slots=4).page_size == 4


def test_too_small_a_pool_is_refused():
    with pytest.raises(ValueError, match="cannot hold one row"):
        PoolLayout.plan(page_size=4, num_prompts=2, prompt_len=6, max_new_tokens=8,
                        num_slots=2, row_pages=1)


@pytest.mark.parametrize("mesh_shape, min_slots", [((8, 1, 1), None), ((2, 2, 2), None),
                                                  ((2, 2, 2), 2)])
def test_engine_on_a_mesh_matches_the_single_device_reference(mesh_shape, min_slots):
    """The 8-device mesh: rows over data x fsdp, heads and vocabulary over tensor (and the
    slots halving 4 -> 2 for the tail)."""
    from tests.rollout import test_engine as dense

    mesh, graphdef, state = dense.policy(mesh_shape)
    config = dataclasses.replace(dense.SAMPLER, engine=EngineConfig(
        max_slots=4, page_size=4, pages_per_block=2, min_slots=min_slots))
    on_mesh = Sampler(graphdef, config, mesh=mesh, rules=dense.ROLLOUT).generate(
        state, dense._prompts(), jax.random.key(0))
    assert_same_rows(on_mesh, dense.single_device_rollout(), atol=1e-5)


def test_ragged_attention_matches_dense_attention_and_the_kernel_reference():
    """Each slot over its own pages ≡ softmax over its tokens gathered densely, and the
    arguments the TPU path builds give the kernel's own reference the same result."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ref_ragged_paged_attention,
    )

    from jaxrl.models.paged_attention import pallas_arguments, ragged_decode_attention

    rng = np.random.default_rng(0)
    slots, heads, kv_heads, dim, page, pages, width = 5, 4, 2, 8, 4, 30, 6
    q_SxNxH = jnp.asarray(rng.standard_normal((slots, heads, dim)), jnp.float32)
    kv_LxPxTx2KxH = jnp.asarray(rng.standard_normal((2, pages, page, 2 * kv_heads, dim)),
                                jnp.float32)
    table_SxM = jnp.asarray(rng.permutation(pages)[:slots * width].reshape(slots, width))
    length_S = jnp.asarray([1, 7, 24, 13, 0], jnp.int32)
    out = ragged_decode_attention(q_SxNxH, kv_LxPxTx2KxH, 1, table_SxM, length_S,
                                  scale=dim ** -0.5, pages_per_block=2)
    for s in range(slots):
        n = int(length_S[s])
        if n == 0:
            np.testing.assert_array_equal(out[s], 0.0)
            continue
        kv = kv_LxPxTx2KxH[1][table_SxM[s]].reshape(-1, 2 * kv_heads, dim)[:n]
        k, v = (jnp.repeat(kv[:, i::2], heads // kv_heads, axis=1) for i in (0, 1))
        p = jax.nn.softmax(jnp.einsum("nh,tnh->nt", q_SxNxH[s], k) * dim ** -0.5, axis=-1)
        np.testing.assert_allclose(out[s], jnp.einsum("nt,tnh->nh", p, v), atol=1e-6)
    live = slice(0, 4)  # the kernel's reference wants every sequence non-empty
    ref = ref_ragged_paged_attention(
        *pallas_arguments(q_SxNxH[live], kv_LxPxTx2KxH[1], table_SxM[live], length_S[live]),
        sm_scale=dim ** -0.5)
    np.testing.assert_allclose(out[live], ref, atol=1e-6)


def test_a_slots_attention_is_the_same_bits_whatever_the_chunks_and_the_other_slots():
    """The XLA path gathers a block only for the chunks of slots that reach it: any chunk
    size, any lengths of the other slots (free ones too), and the loop unrolled over every
    block give a slot the same bits as one chunk of all the slots; a free slot gets zeros."""
    from jaxrl.models.paged_attention import chunk_slots, ragged_decode_attention

    rng = np.random.default_rng(1)
    slots, heads, kv_heads, dim, page, pages, width = 12, 4, 2, 8, 4, 80, 6
    q_SxNxH = jnp.asarray(rng.standard_normal((slots, heads, dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, pages, page, 2 * kv_heads, dim)), jnp.float32)
    table_SxM = jnp.asarray(rng.permutation(pages)[:slots * width].reshape(slots, width))
    length_S = jnp.asarray([0, 24, 3, 0, 9, 17, 1, 0, 12, 5, 24, 8], jnp.int32)

    def attend(length_S, chunk, unroll=False):
        return np.asarray(jax.jit(lambda lengths: ragged_decode_attention(
            q_SxNxH, kv, 1, table_SxM, lengths, scale=dim ** -0.5, pages_per_block=2,
            slots_per_chunk=chunk, unroll=unroll))(length_S))

    whole = attend(length_S, slots)
    for chunk in (2, 3, 5, 8):
        np.testing.assert_array_equal(attend(length_S, chunk), whole, err_msg=f"C={chunk}")
        # Every block for every chunk, loop-free (what FLOP accounting compiles).
        np.testing.assert_array_equal(attend(length_S, chunk, unroll=True), whole,
                                      err_msg=f"unrolled, C={chunk}")
    # Slot 4's output when every other slot is free, or as long as the longest.
    for other in (0, 24):
        alone = attend(jnp.where(jnp.arange(slots) == 4, length_S, other), 2)
        np.testing.assert_array_equal(alone[4], whole[4], err_msg=f"others at {other}")
    np.testing.assert_array_equal(whole[length_S == 0], 0.0)
    assert [chunk_slots(s) for s in (2, 8, 64, 65, 512)] == [2, 8, 8, 9, 64]


def test_auto_min_slots_halves_only_a_long_tail_of_continuous_batching():
    auto = EngineConfig()
    assert auto.min_slots == "auto"
    assert tail_min_slots(auto, 64, 256) == 2
    assert tail_min_slots(auto, 512, 256) == 16  # S / 32: five halvings at most
    assert tail_min_slots(auto, 16, 64) == 2
    assert tail_min_slots(auto, 256, 4) is None  # the quickstart: no tail to halve
    assert tail_min_slots(EngineConfig(batching="static"), 64, 256) is None
    assert tail_min_slots(EngineConfig(min_slots=8), 64, 4) == 8
    assert tail_min_slots(EngineConfig(min_slots=None), 64, 256) is None
    with pytest.raises(ValueError, match="min_slots must be >= 2, 'auto' or null, got 'some'"):
        EngineConfig(min_slots="some")


@pytest.mark.parametrize("slots, min_slots", [(3, None), (ROWS, 2)])
def test_the_pool_is_updated_in_place(slots, min_slots):
    """No copy of the whole KV pool anywhere in the compiled rollout (XLA writes the
    donated-in-place loop carry with scatters), also from one slot tier's loop to the next."""
    import re

    sampler_ = engine_sampler(0.7, slots, min_slots=min_slots)
    graphdef, state = policy(*LLAMA)
    hlo = sampler_._generate.lower(state, prompts(), jax.random.key(0), None).compile().as_text()
    config = sampler_.config
    cfg = nnx.merge(graphdef, state).config
    layout = PoolLayout.plan(page_size=4, num_prompts=len(PROMPT_LENGTHS),
                             prompt_len=max(PROMPT_LENGTHS), max_new_tokens=NEW_TOKENS,
                             num_slots=slots, row_pages=config.engine.row_pages)
    pool = f"f32[{cfg.num_layers},{layout.num_pages},4,{2 * cfg.num_kv_heads},{cfg.head_dim}]"
    copies = [line for line in hlo.splitlines() if re.search(rf"= {re.escape(pool)}\S* copy\(", line)]
    assert pool in hlo and not copies, copies


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe"])
def test_engine_matches_the_reference_for_every_family(family):
    """q/k/v biases (qwen2), q/k norms (qwen3), a sliding window (mistral), a mixture of
    experts routed per token in the paged decode (qwen3_moe)."""
    from tests.rollout.test_sampler import T07, sampler

    graphdef, state = policy(family, "float32")
    config = dataclasses.replace(T07, engine=EngineConfig(max_slots=3, page_size=2,
                                                          pages_per_block=2))
    engine = Sampler(graphdef, config).generate(state, prompts(), jax.random.key(0))
    reference = sampler(T07, family, "float32").generate(state, prompts(), jax.random.key(0))
    assert_same_rows(engine, reference, atol=1e-5)


def _pool_pages(compiled, config, page_size):
    """Pages of the KV pool one device allocates: the [layers, pages, page_size, 2K', head
    dim] buffer of the compiled, partitioned program."""
    shapes = re.findall(r"f32\[(\d+),(\d+),(\d+),(\d+),(\d+)\]", compiled.as_text())
    return max(int(n) for layers, n, page, _, h in shapes
               if (int(layers), int(page), int(h)) == (config.num_layers, page_size,
                                                      config.head_dim))


def test_each_device_holds_only_its_own_slots_pages():
    """On 8 devices (rows over data x fsdp), each device's pool is an eighth of the
    single-device one: its own prompt's home pages and its own 2 slots' row pages (8
    prompts x 2 samples, 16 slots in all)."""
    from tests.rollout import test_engine as dense

    mesh, graphdef, state = dense.policy((8, 1, 1))
    config = dataclasses.replace(dense.SAMPLER, engine=EngineConfig(max_slots=16, page_size=4))
    ids = jnp.asarray(np.arange(8 * 6).reshape(8, 6) % 40 + 3, jnp.int32)
    prompts, key = Prompts(ids, jnp.ones((8, 6), bool)), jax.random.key(0)

    def pages(sampler, state):
        compiled = jax.jit(sampler.generate_traced).lower(state, prompts, key).compile()
        return _pool_pages(compiled, dense.CONFIG, 4)

    one = pages(Sampler(graphdef, config), jax.device_put(state, jax.devices()[0]))
    eight = pages(Sampler(graphdef, config, mesh=mesh, rules=dense.ROLLOUT), state)
    assert one % 8 == 0 and eight == one // 8, (one, eight)
