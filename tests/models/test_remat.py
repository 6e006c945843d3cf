"""Rematerialisation changes what the backward pass stores, never the numbers: remat ≡ no
remat for the loss and every gradient, while the compiled backward pass really recomputes
(more FLOPs: "block" recomputes each block's whole forward, "save_dots" all but its weight
matmuls)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer, from_pretrained, save_pretrained
from tests.conftest import make_tiny_config

PADS = np.array([0, 3, 1, 5])  # left padding of each row


def _batch(config, seq=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (len(PADS), seq)).astype(np.int32)
    mask = np.arange(seq)[None, :] >= PADS[:, None]
    targets = rng.integers(0, config.vocab_size, ids.shape).astype(np.int32)
    return ids, mask, targets


@functools.cache
def _state(scan_layers):
    """Random params (seed 0); the remat policy lives in the graphdef, so all policies share them."""
    return nnx.state(Transformer(make_tiny_config("qwen3", scan_layers=scan_layers),
                                 rngs=nnx.Rngs(0)))


@functools.cache
def _compiled(remat, scan_layers):
    """(compiled value_and_grad of the mean -log p(target) over real tokens, its params).

    A scalar loss through jax.grad: on jax 0.10.2 CPU `jit(jacrev)` of RMSNorm miscompiles.
    """
    config = make_tiny_config("qwen3", scan_layers=scan_layers, remat=remat)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))

    def loss(state, ids, mask, targets):
        logits = nnx.merge(graphdef, state)(ids, attention_mask=mask)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return -jnp.sum(logp * mask) / jnp.sum(mask)

    state = _state(scan_layers)
    return jax.jit(jax.value_and_grad(loss)).lower(state, *_batch(config)).compile(), state


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("remat", ["block", "save_dots"])
def test_remat_gives_the_same_loss_and_gradients(remat, scan_layers):
    batch = _batch(make_tiny_config("qwen3"))
    f, state = _compiled("none", scan_layers)
    loss, grads = f(state, *batch)
    f_remat, _ = _compiled(remat, scan_layers)
    loss_remat, grads_remat = f_remat(state, *batch)
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-5, atol=1e-6)
    grads, grads_remat = (nnx.to_flat_state(g) for g in (grads, grads_remat))
    assert [p for p, _ in grads_remat] == [p for p, _ in grads]
    for (path, g), (_, g_remat) in zip(grads, grads_remat, strict=True):
        assert np.any(g[...] != 0), path  # every parameter gets a gradient to compare
        np.testing.assert_allclose(g_remat[...], g[...], rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_compiled_backward_pass_recomputes(scan_layers):
    flops = {remat: _compiled(remat, scan_layers)[0].cost_analysis()["flops"]
             for remat in ("none", "save_dots", "block")}
    # save_dots recomputes norms, RoPE, activations and attention; block recomputes also the
    # weight matmuls.
    assert flops["none"] < flops["save_dots"] < flops["block"], flops


def test_from_pretrained_takes_the_policy(tmp_path):
    config = make_tiny_config("llama")
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), tmp_path)
    assert from_pretrained(tmp_path).config.remat == "none"
    assert from_pretrained(tmp_path, remat="save_dots", scan_layers=True).config.remat == "save_dots"


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="remat 'all' is not supported; expected one of 'none', 'block', 'save_dots'"):
        make_tiny_config("llama", remat="all")
