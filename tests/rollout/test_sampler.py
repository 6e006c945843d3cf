"""KV-cache sampler: greedy ≡ argmax of full forwards, sampler log-probs ≡ trainer log-probs,
keys, GRPO groups, left padding, early stop, scanned ≡ unrolled layers."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer
from jaxrl.models.lora_config import LORA_MODULES, LoraConfig
from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams, sample_dense
from tests.conftest import FAMILIES, make_tiny_config

# The default init (std 0.02, unit norms) gives near-uniform logits, and with tied embeddings
# the residual stream is dominated by the current token's embedding, so greedy decoding just
# repeats it. Layer weights with std 0.1 make attention and MLPs matter, and a final norm scale
# of 20 multiplies the logits by 20 (|logit| up to ~25; sampled tokens have log-prob ~-2 on
# average). Scaling every weight instead amplifies fp32 roundoff through the layers.
LAYER_STD, OTHER_STD, SHARPEN = 0.1, 0.02, 20.0
PROMPT_LENGTHS = (6, 3, 5, 2)
NEW_TOKENS = 8
GROUP = 2
T07 = SamplerConfig(NEW_TOKENS, GROUP, sampling=SamplingParams(0.7))
GREEDY = SamplerConfig(NEW_TOKENS, GROUP, sampling=SamplingParams(0.0))
LLAMA = ("llama", "float32")


@functools.cache
def policy(family, dtype):
    """(graphdef, state) of a random model (float32 weights), filled in numpy: no init compile."""
    config = make_tiny_config(family, compute_dtype=dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def fill(path, leaf):
        if path[-1].key == "scale":  # RMSNorm
            return jnp.full(leaf.shape, SHARPEN if path[0].key == "final_norm" else 1.0)
        std = LAYER_STD if path[0].key == "layers" else OTHER_STD
        return jnp.asarray(std * rng.standard_normal(leaf.shape), leaf.dtype)

    pure = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


@functools.cache
def sampler(config, family, dtype):
    """One compiled sampler per (config, model), shared by the tests that use it."""
    return Sampler(policy(family, dtype)[0], config)


@functools.cache
def trainer_forward(family, dtype):
    graphdef = policy(family, dtype)[0]
    return jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, None, mask))


def prompts():
    """Left-padded prompts of PROMPT_LENGTHS (pad id 0, real ids >= 2)."""
    rng = np.random.default_rng(1)
    width = max(PROMPT_LENGTHS)
    mask_BxP = np.arange(width)[None, :] >= width - np.asarray(PROMPT_LENGTHS)[:, None]
    ids_BxP = np.where(mask_BxP, rng.integers(2, 96, (len(PROMPT_LENGTHS), width)), 0)
    return Prompts(jnp.asarray(ids_BxP, jnp.int32), jnp.asarray(mask_BxP))


def trainer_log_probs(rollout, family, dtype, temperature=0.7):
    """(log_softmax(logits / T), log_softmax(logits)) of each completion token, from one
    full forward over prompt + completion, as the trainer scores it."""
    ids = jnp.concatenate([rollout.prompt_ids_BxP, rollout.completion_ids_BxC], axis=1)
    mask = jnp.concatenate([rollout.prompt_mask_BxP, rollout.completion_mask_BxC], axis=1)
    logits_BxTxV = trainer_forward(family, dtype)(policy(family, dtype)[1], ids, mask)
    width = rollout.prompt_ids_BxP.shape[1]
    # Position t predicts token t + 1: completion token c comes from position width - 1 + c.
    logits_BxCxV = logits_BxTxV[:, width - 1:-1]
    tokens_BxCx1 = rollout.completion_ids_BxC[..., None]

    def take(logp_BxCxV):
        return np.asarray(jnp.take_along_axis(logp_BxCxV, tokens_BxCx1, axis=-1)[..., 0])

    return (take(jax.nn.log_softmax(logits_BxCxV / temperature, axis=-1)),
            take(jax.nn.log_softmax(logits_BxCxV, axis=-1)))


def max_masked_diff(a_BxC, b_BxC, mask_BxC):
    return float(np.max(np.where(mask_BxC, np.abs(a_BxC - b_BxC), 0.0)))


@functools.cache
def greedy_rollout():
    return sampler(GREEDY, *LLAMA).generate(policy(*LLAMA)[1], prompts(), jax.random.key(0))


@functools.cache
def t07_rollout(seed):
    return sampler(T07, *LLAMA).generate(policy(*LLAMA)[1], prompts(), jax.random.key(seed))


def test_greedy_is_argmax_of_repeated_full_forwards():
    """Token by token: run the model over the whole sequence so far, take the argmax."""
    ids, mask = (np.asarray(x) for x in prompts())
    width = ids.shape[1]
    # A fixed-length buffer (one compile): slots after the current token are masked and,
    # being later in the sequence, cannot affect it through causal attention.
    ids = np.concatenate([ids, np.zeros((len(ids), NEW_TOKENS), ids.dtype)], axis=1)
    mask = np.concatenate([mask, np.zeros((len(ids), NEW_TOKENS), bool)], axis=1)
    logp_raw = np.zeros((len(ids), NEW_TOKENS), np.float32)
    for t in range(NEW_TOKENS):
        logits_BxV = trainer_forward(*LLAMA)(policy(*LLAMA)[1], ids, mask)[:, width + t - 1]
        ids[:, width + t] = np.asarray(jnp.argmax(logits_BxV, axis=-1))
        mask[:, width + t] = True
        logp_raw[:, t] = np.asarray(jax.nn.log_softmax(logits_BxV, axis=-1))[
            np.arange(len(ids)), ids[:, width + t]]

    rollout = greedy_rollout()
    expected = np.repeat(ids[:, width:], GROUP, axis=0)
    np.testing.assert_array_equal(rollout.completion_ids_BxC, expected)
    assert np.all(rollout.completion_mask_BxC) and int(rollout.num_steps) == NEW_TOKENS
    np.testing.assert_array_equal(rollout.logp_BxC, 0.0)
    np.testing.assert_allclose(rollout.logp_raw_BxC, np.repeat(logp_raw, GROUP, axis=0),
                               atol=1e-5)
    # The model is context dependent, so this is not one token repeated.
    assert len(np.unique(expected)) > 8


@pytest.mark.parametrize("family", FAMILIES)
def test_log_probs_match_trainer_forward(family):
    """Cached prefill + one-token decode ≡ one full forward, to fp32 roundoff.

    Measured on CPU over 8 keys x 4 families: max |diff| 1.7e-6 to 5.5e-6 per rollout.
    """
    if family == "llama":
        rollout = t07_rollout(0)
    else:
        rollout = sampler(T07, family, "float32").generate(
            policy(family, "float32")[1], prompts(), jax.random.key(0))
    logp, logp_raw = trainer_log_probs(rollout, family, "float32")
    mask = np.asarray(rollout.completion_mask_BxC)
    assert mask.all()
    assert max_masked_diff(rollout.logp_BxC, logp, mask) <= 1e-5
    assert max_masked_diff(rollout.logp_raw_BxC, logp_raw, mask) <= 1e-5


def test_bf16_log_probs_match_trainer_forward():
    """bfloat16 compute (float32 weights and logits), over 8 keys.

    With XLA's excess precision off (`jaxrl.runtime.configure_xla`, as the CLI and conftest
    do), both programs round every bf16 op alike. Measured on CPU, max |diff| per rollout
    over 8 keys: llama median 4.8e-7 / max 9.5e-7; qwen2, mistral max 9.5e-7; qwen3 one
    rollout in 8 at 3.6e-4 (a single bf16 rounding flip, relative 2^-8, in a reduction whose
    order differs between a 1-token decode step and the full forward). With excess precision
    on (XLA's default) the prefill's first token alone differed by 6e-3 to 1.4e-2, which is
    why jaxrl turns it off. Asserted: median <= 2e-6 (fp32 roundoff as a rule) and max <= 1e-3
    (about 3x the largest flip seen).
    """
    state = policy("llama", "bfloat16")[1]
    worst = []
    for seed in range(8):
        rollout = sampler(T07, "llama", "bfloat16").generate(state, prompts(),
                                                             jax.random.key(seed))
        logp, logp_raw = trainer_log_probs(rollout, "llama", "bfloat16")
        mask = np.asarray(rollout.completion_mask_BxC)
        worst.append(max(max_masked_diff(rollout.logp_BxC, logp, mask),
                         max_masked_diff(rollout.logp_raw_BxC, logp_raw, mask)))
    assert np.median(worst) <= 2e-6 and max(worst) <= 1e-3, worst


def test_fixed_key_reproduces_and_other_keys_differ():
    first = t07_rollout(0)
    again = sampler(T07, *LLAMA).generate(policy(*LLAMA)[1], prompts(), jax.random.key(0))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    other = t07_rollout(1)
    differ_B = np.any(np.asarray(first.completion_ids_BxC != other.completion_ids_BxC), axis=1)
    assert differ_B.all()


def test_generations_share_one_prefill_and_are_prompt_major():
    ids, mask = prompts()
    num_prompts, width = ids.shape
    hidden = make_tiny_config("llama").hidden_size
    graphdef, state = policy(*LLAMA)
    jaxpr = str(jax.make_jaxpr(
        lambda s, i, m, k: sample_dense(nnx.merge(graphdef, s), i, m, k, T07))(
        state, ids, mask, jax.random.key(0)))
    # The prefill's activations hold one row per prompt, never one per generation.
    assert f"f32[{num_prompts},{width},{hidden}]" in jaxpr
    assert f"[{num_prompts * GROUP},{width},{hidden}]" not in jaxpr

    rollout = t07_rollout(0)
    np.testing.assert_array_equal(rollout.prompt_ids_BxP, np.repeat(ids, GROUP, axis=0))
    np.testing.assert_array_equal(rollout.prompt_mask_BxP, np.repeat(mask, GROUP, axis=0))
    # Rows g = 0, 1 of each prompt are different samples (the trainer log-prob parity shows
    # each row continues its own prompt).
    tokens_PxGxC = np.asarray(rollout.completion_ids_BxC).reshape(num_prompts, GROUP, -1)
    assert np.all(np.any(tokens_PxGxC[:, 0] != tokens_PxGxC[:, 1], axis=-1))


def test_left_padding_does_not_change_a_prompt_s_samples():
    """Each prompt with its own key: batched (left-padded) ≡ alone (no padding)."""
    batch = prompts()
    keys = jax.random.split(jax.random.key(5), len(PROMPT_LENGTHS))
    batched = sampler(T07, *LLAMA).generate(policy(*LLAMA)[1], batch, keys)
    for p, length in enumerate(PROMPT_LENGTHS):
        unpadded = Prompts(batch.ids_BxP[p:p + 1, -length:], batch.mask_BxP[p:p + 1, -length:])
        alone = sampler(T07, *LLAMA).generate(policy(*LLAMA)[1], unpadded, keys[p:p + 1])
        rows = slice(p * GROUP, (p + 1) * GROUP)
        np.testing.assert_array_equal(batched.completion_ids_BxC[rows], alone.completion_ids_BxC)
        np.testing.assert_array_equal(batched.completion_mask_BxC[rows],
                                      alone.completion_mask_BxC)
        np.testing.assert_allclose(batched.logp_BxC[rows], alone.logp_BxC, atol=1e-5)
        np.testing.assert_allclose(batched.logp_raw_BxC[rows], alone.logp_raw_BxC, atol=1e-5)


def _finish_steps(tokens_BxC, stop_ids):
    """Index of each row's first stop token (the row's length - 1), or C if it never stops."""
    hits_BxC = np.isin(tokens_BxC, stop_ids)
    return np.where(hits_BxC.any(-1), hits_BxC.argmax(-1), tokens_BxC.shape[1])


def test_early_stop():
    """Greedy rows are deterministic, so stopping only truncates the no-stop rollout."""
    full = greedy_rollout()
    tokens_BxC = np.asarray(full.completion_ids_BxC)
    # Stop ids at which every row stops early, at no fewer than three different steps.
    candidates = np.unique(tokens_BxC)
    stop_ids = next(
        ids for size in (1, 2, 3, 4) for ids in itertools.combinations(candidates, size)
        if _finish_steps(tokens_BxC, ids).max() < NEW_TOKENS - 1
        and len(np.unique(_finish_steps(tokens_BxC, ids))) >= 3)
    finish_B = _finish_steps(tokens_BxC, stop_ids)

    pad = 1
    config = SamplerConfig(NEW_TOKENS, GROUP, end_token_ids=tuple(int(i) for i in stop_ids),
                           pad_token_id=pad, sampling=SamplingParams(0.0))
    rollout = sampler(config, *LLAMA).generate(policy(*LLAMA)[1], prompts(), jax.random.key(0))
    mask_BxC = np.arange(NEW_TOKENS)[None, :] <= finish_B[:, None]
    np.testing.assert_array_equal(rollout.completion_mask_BxC, mask_BxC)
    np.testing.assert_array_equal(rollout.completion_ids_BxC, np.where(mask_BxC, tokens_BxC, pad))
    assert np.all(np.isin(tokens_BxC[np.arange(len(finish_B)), finish_B], stop_ids))
    np.testing.assert_array_equal(rollout.logp_raw_BxC,
                                  np.where(mask_BxC, full.logp_raw_BxC, 0.0))
    # The decode loop exited once the longest row had finished.
    assert int(rollout.num_steps) == finish_B.max() + 1 < NEW_TOKENS


def test_scanned_layers_give_the_same_rollout():
    config = make_tiny_config("llama", scan_layers=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    pure = nnx.to_pure_dict(policy(*LLAMA)[1])
    layers = pure.pop("layers")
    pure["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                  *(layers[i] for i in range(config.num_layers)))
    nnx.replace_by_pure_dict(state, pure)
    unrolled = t07_rollout(0)
    through_engine = Sampler(graphdef, T07).generate(state, prompts(), jax.random.key(0))
    # `sample` under a jit that closes over a model built outside it (the layer scan must
    # accept Variables from another trace level, here and in the decode loop).
    model = nnx.merge(graphdef, state)
    closed_over = jax.jit(lambda ids, mask, key: sample_dense(model, ids, mask, key, T07))(
        *prompts(), jax.random.key(0))
    for scanned in (through_engine, closed_over):
        np.testing.assert_array_equal(scanned.completion_ids_BxC, unrolled.completion_ids_BxC)
        np.testing.assert_allclose(scanned.logp_BxC, unrolled.logp_BxC, atol=1e-5)
        np.testing.assert_allclose(scanned.logp_raw_BxC, unrolled.logp_raw_BxC, atol=1e-5)


@functools.cache
def lora_policy(rollout_mode):
    """(graphdef, state) of the llama `policy` with random non-zero LoRA adapters on every
    projection, applied by the rollout as `rollout_mode`."""
    lora = LoraConfig(4, 8.0, LORA_MODULES, rollout=rollout_mode)
    model = nnx.merge(*policy(*LLAMA))
    config = dataclasses.replace(model.config, lora=lora)
    graphdef, adapters, _ = nnx.split(nnx.eval_shape(lambda: Transformer(config,
                                                                         rngs=nnx.Rngs(0))),
                                      nnx.LoRAParam, ...)
    rng = np.random.default_rng(2)
    adapters = jax.tree.map(lambda x: jnp.asarray(0.03 * rng.standard_normal(x.shape),
                                                  x.dtype), adapters)
    return graphdef, nnx.merge_state(adapters, policy(*LLAMA)[1])


@pytest.mark.parametrize("rollout_mode", ["merged", "on_the_fly"])
def test_lora_log_probs_match_trainer_forward(rollout_mode):
    """The rollout's base + adapters (merged per call, or applied per token) ≡ the trainer's
    forward (adapters applied at each projection), to fp32 roundoff, and ≠ the base's.

    Measured on CPU (key 0): max |diff| 4.3e-6 merged, 3.8e-6 on the fly, as without LoRA
    (1.7e-6 to 5.5e-6). With 10x larger adapters (std 0.3, dominating the 0.1 base) both
    grow alike (3.1e-5, 1.8e-5): larger activations amplify fp32 roundoff in either mode.
    """
    graphdef, state = lora_policy(rollout_mode)
    rollout = Sampler(graphdef, T07).generate(state, prompts(), jax.random.key(0))
    ids = jnp.concatenate([rollout.prompt_ids_BxP, rollout.completion_ids_BxC], axis=1)
    mask = jnp.concatenate([rollout.prompt_mask_BxP, rollout.completion_mask_BxC], axis=1)
    logits_BxTxV = jax.jit(lambda s: nnx.merge(graphdef, s)(ids, None, mask))(state)
    width = rollout.prompt_ids_BxP.shape[1]
    logp_BxCxV = jax.nn.log_softmax(logits_BxTxV[:, width - 1:-1] / 0.7, axis=-1)
    logp = np.asarray(jnp.take_along_axis(logp_BxCxV, rollout.completion_ids_BxC[..., None],
                                          axis=-1)[..., 0])
    mask_BxC = np.asarray(rollout.completion_mask_BxC)
    assert max_masked_diff(rollout.logp_BxC, logp, mask_BxC) <= 1e-5
    base_logp, _ = trainer_log_probs(rollout, *LLAMA)
    assert max_masked_diff(base_logp, logp, mask_BxC) > 1e-2  # the adapters matter
