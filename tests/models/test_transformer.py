"""Invariants of the decoder: sharded ≡ unsharded, cached decoding ≡ full forward, causality,
padding independence, scan ≡ no scan, jit ≡ eager, bf16 ≈ fp32.

Tolerances are relative to the magnitude of the reference (`_close`): fp32 results that differ
only by the order of floating-point reductions (sharded partial sums, fused vs unfused ops,
cached vs full attention) must agree to 1e-5 of the largest entry. fp32 epsilon is 1.2e-7 and
the reductions here sum at most 96 terms; honest reorderings measured <= 8e-7. Any real
error (a wrong mask, a misplaced cache slot, a mis-sharded reduction) is of order one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models import KVCache, Transformer, default_positions
from jaxrl.models.transformer import CACHE_AXES
from jaxrl.sharding import create_sharded, load_layout, make_mesh, state_shardings, use_rules
from jaxrl.sharding.layout import Layout, MeshAxes
from tests.conftest import FAMILIES, make_tiny_config

SEQ = 12
PADS = np.array([0, 3, 1, 5, 0, 2, 7, 4])  # left padding of each of the 8 rows
TRAIN_RULES = load_layout("fsdp_tp").train_rules
RTOL = 1e-5


def _close(actual, reference, mask_BxT=None, rtol=RTOL):
    """max |actual - reference| <= rtol * max |reference| (over unmasked positions)."""
    actual, reference = np.asarray(actual), np.asarray(reference)
    assert actual.shape == reference.shape
    if mask_BxT is not None:
        actual, reference = actual[mask_BxT], reference[mask_BxT]
    scale = np.max(np.abs(reference))
    assert scale > 0
    err = np.max(np.abs(actual - reference))
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x {scale:.3g}"


def _batch(config, pads=PADS, seq=SEQ, seed=0):
    """Random token ids, a left-padding mask and targets."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (len(pads), seq)).astype(np.int32)
    mask = np.arange(seq)[None, :] >= np.asarray(pads)[:, None]
    targets = rng.integers(0, config.vocab_size, ids.shape).astype(np.int32)
    return ids, mask, targets


@functools.cache
def _model(config) -> Transformer:
    """An eagerly initialised model (seed 0), shared by the tests that only read it."""
    return Transformer(config, rngs=nnx.Rngs(0))


def _forward(graphdef):
    return jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, attention_mask=mask))


# ------------------------------------------------------------------ sharded ≡ unsharded

def _loss(graphdef):
    """(mean -log p(target) over real tokens, logits) as a function of the params."""
    def loss(state, ids, mask, targets):
        logits = nnx.merge(graphdef, state)(ids, attention_mask=mask)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return -jnp.sum(logp * mask) / jnp.sum(mask), logits
    return loss


def _loss_and_grad(graphdef):
    """((loss, logits), gradient of the loss w.r.t. every param), jitted."""
    return jax.jit(jax.value_and_grad(_loss(graphdef), has_aux=True))


@functools.cache
def _unsharded(config):
    """Params created by `create_sharded` on one device, and their loss, logits and grads."""
    mesh = make_mesh(load_layout("single"), jax.devices()[:1])
    graphdef, state = nnx.split(
        create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, TRAIN_RULES))
    return state, _loss_and_grad(graphdef)(state, *_batch(config))


@pytest.mark.parametrize("mesh_shape, family, scan_layers", [
    ((8, 1, 1), "llama", False),
    ((1, 8, 1), "llama", False),
    ((1, 4, 2), "llama", False),
    ((2, 2, 2), "llama", False),
    # 2 kv heads on tensor=4: k/v projections fall back to replication, q stays split.
    ((1, 2, 4), "llama", False),
    # Tied embeddings (the table is both looked up and the logit matrix), q/k-norm, layer scan.
    ((2, 2, 2), "qwen3", True),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_sharded_matches_unsharded(mesh_shape, family, scan_layers):
    config = make_tiny_config(family, scan_layers=scan_layers)
    ref_state, ((ref_loss, ref_logits), ref_grads) = _unsharded(config)
    mesh = make_mesh(Layout("test", MeshAxes(*mesh_shape), 1, TRAIN_RULES, TRAIN_RULES))
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, TRAIN_RULES)
    graphdef, state = nnx.split(model)
    # The same seed gives bit-identical params, whatever the layout.
    jax.tree.map(np.testing.assert_array_equal, state, ref_state)

    ids, mask, targets = _batch(config)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with use_rules(mesh, TRAIN_RULES):
        (loss, logits), grads = _loss_and_grad(graphdef)(
            state, *(jax.device_put(x, rows) for x in (ids, mask, targets)))
    # The activation constraints were applied: logits are split by rows (and vocab on tensor).
    assert logits.sharding.is_equivalent_to(
        TRAIN_RULES.sharding(("batch", "seq", "act_vocab"), logits.shape, mesh), 3)
    _close(logits, ref_logits, mask)
    _close(loss, ref_loss)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    jax.tree.map(_close, grads, ref_grads)


# ------------------------------------------------------------------ KV cache ≡ full forward

def _decode_logits(model, ids, mask, prefill_chunks, cache_len):
    """Prefill the first sum(prefill_chunks) tokens with `extend` in those chunks, then feed
    the rest one at a time; returns the logits of every token and the final cache."""
    positions = default_positions(jnp.asarray(mask))
    extend = nnx.jit(lambda m, i, p, c, a: m.extend(i, p, c, a))
    cache = KVCache.init(model.config, ids.shape[0], cache_len)
    bounds = np.cumsum([0, *prefill_chunks, *[1] * (ids.shape[1] - sum(prefill_chunks))])
    outs = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        logits, cache = extend(model, ids[:, start:stop], positions[:, start:stop], cache,
                               mask[:, start:stop])
        outs.append(logits)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("family, scan_layers, prefill_chunks", [
    ("llama", False, (6,)),
    ("llama", True, (6,)),
    ("qwen2", False, (6,)),
    ("qwen3", False, (6,)),
    # sliding_window=4 < SEQ: the window matters in prefill and in every decode step.
    ("mistral", False, (6,)),
    ("mistral", True, (2, 4)),
], ids=lambda v: "+".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_cached_decode_matches_full_forward(family, scan_layers, prefill_chunks):
    config = make_tiny_config(family, scan_layers=scan_layers)
    model = _model(config)
    ids, mask, _ = _batch(config)
    graphdef, state = nnx.split(model)
    full = _forward(graphdef)(state, ids, mask)
    # The cache is longer than the sequence: unwritten slots must be ignored.
    decoded, cache = _decode_logits(model, ids, mask, prefill_chunks, SEQ + 3)
    _close(decoded, full, mask)
    assert int(cache.end) == SEQ
    np.testing.assert_array_equal(cache.valid_BxS[:, :SEQ], mask)
    assert not cache.valid_BxS[:, SEQ:].any()


def test_sharded_decode_with_rollout_rules_matches_unsharded():
    config = make_tiny_config("llama")
    model = _model(config)
    ids, mask, _ = _batch(config)
    expected, _ = _decode_logits(model, ids, mask, (6,), SEQ)
    layout = load_layout("dp_fsdp_tp")
    mesh, rules = make_mesh(layout), layout.rollout_rules
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh, rules)))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with use_rules(mesh, rules):
        decoded, cache = _decode_logits(sharded, jax.device_put(ids, rows),
                                        jax.device_put(mask, rows), (6,), SEQ)
    assert cache.k.sharding.is_equivalent_to(rules.sharding(CACHE_AXES, cache.k.shape, mesh), 5)
    _close(decoded, expected, mask)


def test_prefill_in_two_chunks_equals_one_chunk():
    config = make_tiny_config("mistral")
    model = _model(config)
    ids, mask, _ = _batch(config)
    ids, mask = ids[:, :8], mask[:, :8]
    one, cache_one = _decode_logits(model, ids, mask, (8,), 8)
    # Rows 3, 6 and 7 are all padding in the first chunk.
    two, cache_two = _decode_logits(model, ids, mask, (5, 3), 8)
    _close(two, one, mask)
    valid = np.asarray(cache_one.valid_BxS)
    np.testing.assert_array_equal(cache_two.valid_BxS, valid)
    for a, b in ((cache_two.k, cache_one.k), (cache_two.v, cache_one.v)):
        _close(np.asarray(a)[:, valid], np.asarray(b)[:, valid])


def test_last_only_prefill_gives_the_last_column_and_the_same_cache():
    config = make_tiny_config("qwen3")
    model = _model(config)
    ids, mask, _ = _batch(config)
    positions = default_positions(jnp.asarray(mask))
    extend = nnx.jit(lambda m, i, p, c, a, last: m.extend(i, p, c, a, last_only=last),
                     static_argnames="last")
    cache = KVCache.init(config, ids.shape[0], SEQ)
    every, cache_every = extend(model, ids, positions, cache, mask, False)
    last, cache_last = extend(model, ids, positions, cache, mask, True)
    assert last.shape == (ids.shape[0], 1, config.vocab_size)
    np.testing.assert_array_equal(last[:, 0], every[:, -1])
    jax.tree.map(np.testing.assert_array_equal, cache_last, cache_every)


def test_cache_can_be_donated_and_refuses_more_tokens_than_slots():
    config = make_tiny_config("llama")
    model = _model(config)
    cache = KVCache.init(config, 2, 4)
    # k and v are separate buffers, so a step may donate the whole cache.
    step = jax.jit(lambda c: c._replace(end=c.end + 1), donate_argnums=0)
    assert int(step(cache).end) == 1
    with pytest.raises(ValueError, match="cannot append 5 tokens to a KV cache of 4 slots"):
        model.extend(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5), jnp.int32),
                     KVCache.init(config, 2, 4))


# ------------------------------------------------------------------ causality and padding

def test_outputs_never_depend_on_later_or_other_rows_inputs():
    config = make_tiny_config("llama")
    model = _model(config)
    graphdef, state = nnx.split(model)
    ids, mask, _ = _batch(config, pads=np.array([0, 3]), seq=8)
    x = model.embed_tokens(jnp.asarray(ids))
    positions = default_positions(jnp.asarray(mask))

    # One pullback per output position with a random cotangent over its logits: the input
    # gradient is exactly zero wherever the output cannot depend on the input. (Not jacrev
    # under jit: jax 0.10.2's XLA:CPU miscompiles the batched pullback of RMSNorm once the
    # batch of cotangents is large, mixing rows, while a single pullback is correct.)
    @jax.jit
    def input_grad(x, cotangent):
        logits = lambda x: nnx.merge(graphdef, state).forward_embeddings(  # noqa: E731
            x, positions, jnp.asarray(mask))
        return jax.vjp(logits, x)[1](cotangent)[0]

    rng = np.random.default_rng(1)
    for b, t in np.ndindex(2, 8):
        cotangent = np.zeros((2, 8, config.vocab_size), np.float32)
        cotangent[b, t] = rng.normal(size=config.vocab_size)
        influence = np.abs(np.asarray(input_grad(x, cotangent))).max(axis=-1)  # [B, S]
        for b2, s in np.ndindex(2, 8):
            # Real queries see earlier real keys of their row; a pad query sees only itself.
            depends = b2 == b and s <= t and (s == t or (mask[b, s] and mask[b, t]))
            if depends:
                assert influence[b2, s] > 0, (b, t, b2, s)
            else:
                assert influence[b2, s] == 0, (b, t, b2, s)


@pytest.mark.parametrize("family", FAMILIES)
def test_valid_logits_do_not_depend_on_pad_token_ids(family):
    config = make_tiny_config(family)
    graphdef, state = nnx.split(_model(config))
    ids, mask, _ = _batch(config)
    other = np.where(mask, ids, (ids * 7 + 5) % config.vocab_size)
    assert (other != ids).any()
    forward = _forward(graphdef)
    # Padding keys get exactly zero attention weight, so the result is bit-identical.
    np.testing.assert_array_equal(np.asarray(forward(state, other, mask))[mask],
                                  np.asarray(forward(state, ids, mask))[mask])


# ------------------------------------------------------------------ scan, jit, dtypes

@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scan_layers_matches_unrolled_layers(family):
    plain = _model(make_tiny_config(family))
    scanned = _model(make_tiny_config(family, scan_layers=True))
    # Stack the unrolled model's layer params onto the scanned model's `layers` axis.
    params = nnx.to_pure_dict(nnx.state(plain))
    layers = params.pop("layers")
    params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in sorted(layers)))
    graphdef, state = nnx.split(scanned)  # a copy of the params: the cached model is kept
    nnx.replace_by_pure_dict(state, params)

    ids, mask, _ = _batch(plain.config)
    expected = _forward(nnx.graphdef(plain))(nnx.state(plain), ids, mask)
    _close(_forward(graphdef)(state, ids, mask), expected, mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_jit_matches_eager(family):
    model = _model(make_tiny_config(family))
    ids, mask, _ = _batch(model.config)
    eager = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    jitted = nnx.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids, mask)
    assert eager.dtype == jitted.dtype == jnp.float32
    _close(jitted, eager, mask)


def test_jit_matches_eager_gradients():
    # qwen2 ties the embeddings: the table's gradient sums the lookup and the logit paths.
    config = make_tiny_config("qwen2")
    graphdef, state = nnx.split(_model(config))
    batch = _batch(config)
    (loss, _), grads = jax.value_and_grad(_loss(graphdef), has_aux=True)(
        state, *(jnp.asarray(x) for x in batch))
    (jit_loss, _), jit_grads = _loss_and_grad(graphdef)(state, *batch)
    _close(jit_loss, loss)
    jax.tree.map(_close, jit_grads, grads)


# bf16 keeps 8 significant bits: each rounding is off by up to 2^-9 ≈ 0.2%. Through two
# layers and the logit matmul the measured error is 0.3-0.6% of the largest logit for the
# four tiny families; 2% leaves >3x headroom, while real errors (a dropped residual, a
# wrong mask) are of order one.
BF16_RTOL = 2e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_compute_with_fp32_params_stays_close_to_fp32(family):
    fp32 = _model(make_tiny_config(family))
    bf16 = Transformer(make_tiny_config(family, compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    state = nnx.state(bf16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))
    jax.tree.map(np.testing.assert_array_equal, state, nnx.state(fp32))
    ids, mask, _ = _batch(fp32.config)
    logits = _forward(nnx.graphdef(bf16))(state, ids, mask)
    assert logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    _close(logits, _forward(nnx.graphdef(fp32))(nnx.state(fp32), ids, mask), mask, BF16_RTOL)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied output projection
def test_hidden_states_times_output_embedding_are_the_logits(family):
    config = make_tiny_config(family)
    model = _model(config)
    ids, mask, _ = _batch(config)
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    hidden = model.hidden_states(jnp.asarray(ids), jnp.asarray(mask))
    assert hidden.shape == (*ids.shape, config.hidden_size)
    _close(jnp.einsum("bte,ev->btv", hidden, model.output_embedding()), logits, mask)


# ------------------------------------------------------------------ shared prompts ≡ whole rows

def _grouped_rows(config, groups=3, group=4, prompt_len=7, completion_len=5):
    """N prompts (left-padded, one with no padding), G continuations of each (some ending
    early), and the B = N·G whole rows prompt[b // G] ⊕ continuation[b] with their mask."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, config.vocab_size, (groups, prompt_len)).astype(np.int32)
    prompt_mask = np.arange(prompt_len)[None, :] >= np.array([3, 0, 5])[:groups, None]
    rest = rng.integers(0, config.vocab_size, (groups * group, completion_len)).astype(np.int32)
    ends = rng.integers(1, completion_len + 1, groups * group)
    rest_mask = np.arange(completion_len)[None, :] < ends[:, None]
    ids = np.concatenate([np.repeat(prompt, group, axis=0), rest], axis=1)
    mask = np.concatenate([np.repeat(prompt_mask, group, axis=0), rest_mask], axis=1)
    return (prompt, prompt_mask, rest, rest_mask), (ids, mask)


@pytest.mark.parametrize("family", FAMILIES)  # qwen3: qk-norm; mistral: sliding window of 4
@pytest.mark.parametrize("scan,remat", [(False, "none"), (True, "block")])
def test_shared_prompt_forward_and_gradients_match_whole_rows(family, scan, remat):
    config = make_tiny_config(family, scan_layers=scan, remat=remat)
    model = _model(config)
    (prompt, prompt_mask, rest, rest_mask), (ids, mask) = _grouped_rows(config)
    graphdef, state = nnx.split(model)
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(config.hidden_size),
                          jnp.float32)

    def whole(state):
        hidden = nnx.merge(graphdef, state).hidden_states(jnp.asarray(ids), jnp.asarray(mask))
        return jnp.sum(jnp.where(jnp.asarray(mask)[..., None], hidden * weights, 0.0)), hidden

    def shared(state):
        p, c = nnx.merge(graphdef, state).hidden_states_shared_prompt(
            jnp.asarray(prompt), jnp.asarray(prompt_mask), jnp.asarray(rest),
            jnp.asarray(rest_mask))
        hidden = jnp.concatenate([jnp.repeat(p, 4, axis=0), c], axis=1)
        # Each prompt counted once per row, as in the whole-row loss.
        return jnp.sum(jnp.where(jnp.asarray(mask)[..., None], hidden * weights, 0.0)), hidden

    (_, want), grads_want = jax.jit(jax.value_and_grad(whole, has_aux=True))(state)
    (_, got), grads_got = jax.jit(jax.value_and_grad(shared, has_aux=True))(state)
    _close(got, want, mask)
    for name, g_want in nnx.to_flat_state(grads_want):
        g_got = dict(nnx.to_flat_state(grads_got))[name]
        if np.any(np.asarray(g_want.get_value())):
            _close(g_got.get_value(), g_want.get_value())
        else:  # the output projection: not part of the hidden states
            np.testing.assert_array_equal(g_got.get_value(), 0.0)


def test_shared_prompt_forward_rejects_rows_that_do_not_split_into_groups():
    config = make_tiny_config("llama")
    (prompt, prompt_mask, rest, rest_mask), _ = _grouped_rows(config)
    with pytest.raises(ValueError, match="12 continuation rows .* 5 prompts"):
        _model(config).hidden_states_shared_prompt(
            jnp.asarray(np.concatenate([prompt, prompt[:2]])),
            jnp.asarray(np.concatenate([prompt_mask, prompt_mask[:2]])), jnp.asarray(rest),
            jnp.asarray(rest_mask))
