"""The train state on a 2x2x2 mesh: moments sharded like their params, counters replicated,
a donated sharded update ≡ the same update on one device, decay on matrices only, a
reference copy that outlives a donating step, and a state built around an existing model
≡ one created from the same seed.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.config import OptimSection
from jaxrl.models import Transformer
from jaxrl.sharding import (
    AxisRules,
    create_sharded,
    load_layout,
    make_mesh,
    reshard,
    state_shardings,
    use_rules,
)
from jaxrl.sharding.layout import Layout, MeshAxes
from jaxrl.step import TrainState, create_train_state, reference_params
from jaxrl.step.state import train_state_from_model
from tests.conftest import make_tiny_config

RULES = AxisRules.from_mapping({
    "batch": ["data", "fsdp"], "embed": "fsdp", "vocab": "tensor", "heads": "tensor",
    "kv_heads": "tensor", "mlp": "tensor"})
# Biases, stacked [layers, ...] params and tied embeddings in one tiny model.
CONFIG = make_tiny_config("qwen2", scan_layers=True)
# eps well above fp32 roundoff of the gradients: Adam's first step, lr * g / (|g| + eps), is
# then smooth in g, so an entry within roundoff of 0 cannot flip sign between the layouts.
OPTIM = OptimSection(lr=1e-2, eps=1e-3, weight_decay=0.1, max_grad_norm=1.0)


def _mesh():
    return make_mesh(Layout("test", MeshAxes(2, 2, 2), 1, RULES, RULES))


def _create(mesh) -> TrainState:
    return create_train_state(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), OPTIM, mesh, RULES)


@functools.cache
def _sharded_state():
    """(mesh, graphdef, state) on the 2x2x2 mesh, created once; `_fresh` gives a copy."""
    mesh = _mesh()
    return mesh, *nnx.split(_create(mesh))


def _fresh() -> TrainState:
    """A new copy of the sharded train state (which a test may donate or update)."""
    _, graphdef, state = _sharded_state()
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.copy(), state))


def _params(ts: TrainState) -> nnx.State:
    return nnx.state(ts.model, nnx.Param)


def _moments(ts: TrainState, name: str) -> nnx.State:
    return optax.tree_utils.tree_get(ts.optimizer.opt_state, name)


def _batch(seq=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CONFIG.vocab_size, (8, seq)).astype(np.int32)
    mask = np.arange(seq)[None, :] >= rng.integers(0, 4, 8)[:, None]
    return ids, mask


def _loss(model, ids, mask):
    """Mean next-token -log p over real tokens."""
    logits = model(ids, attention_mask=mask)[:, :-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
    return -jnp.sum(logp * mask[:, 1:]) / jnp.sum(mask[:, 1:])


def _step_fn(graphdef, shardings=None, mesh=None):
    """One update of the state, jitted; with `shardings` pinned to them and donating the state."""
    def step(state, ids, mask):
        ts = nnx.merge(graphdef, state)
        with contextlib.nullcontext() if mesh is None else use_rules(mesh, RULES):
            grads = nnx.grad(_loss)(ts.model, ids, mask)
        ts.apply_gradients(grads)
        return nnx.state(ts)
    if shardings is None:
        return jax.jit(step)
    return jax.jit(step, in_shardings=(shardings, None, None), out_shardings=shardings,
                   donate_argnums=0)


@functools.cache
def _unsharded_after_one_step():
    """(initial params, state after one update), all on one device."""
    ts = _create(make_mesh(load_layout("single"), jax.devices()[:1]))
    graphdef, state = nnx.split(ts)
    initial = jax.tree.map(np.asarray, _params(ts))
    return initial, nnx.merge(graphdef, _step_fn(graphdef)(state, *_batch()))


def test_moments_are_sharded_like_their_params_and_counters_replicated():
    ts = _fresh()
    params = _params(ts)
    param_shardings = [x.sharding for x in jax.tree.leaves(params)]
    # Not vacuous: the layout really splits parameters over both fsdp and tensor.
    assert any(s.spec and "fsdp" in s.spec and "tensor" in s.spec for s in param_shardings)
    assert params["embed"].sharding.spec == P("tensor", "fsdp")
    for name in ("mu", "nu"):
        moments = _moments(ts, name)
        assert jax.tree.structure(nnx.as_pure(moments)) == jax.tree.structure(nnx.as_pure(params))
        for m, p, s in zip(jax.tree.leaves(moments), jax.tree.leaves(params), param_shardings,
                           strict=True):
            assert m.shape == p.shape and m.dtype == p.dtype
            assert m.sharding == s
    counters = [x for x in jax.tree.leaves(ts.optimizer.opt_state) if x.ndim == 0]
    assert len(counters) >= 2  # Adam's count and the schedule's count
    for x in [ts.optimizer.step[...], *counters]:
        assert x.sharding.is_fully_replicated
    assert int(ts.step) == 0


def test_donated_sharded_step_keeps_shardings_and_matches_unsharded():
    mesh = _sharded_state()[0]
    graphdef, state = nnx.split(_fresh())
    shardings = jax.tree.map(lambda x: x.sharding, state)
    initial, reference = _unsharded_after_one_step()
    # The same seed gives the same params whatever the layout.
    jax.tree.map(np.testing.assert_array_equal, _params(nnx.merge(graphdef, state)), initial)

    rows = NamedSharding(mesh, P(("data", "fsdp")))
    batch = [jax.device_put(x, rows) for x in _batch()]
    new_state = _step_fn(graphdef, shardings, mesh)(state, *batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state)), "the step donates its state"
    assert jax.tree.map(lambda x: x.sharding, new_state) == shardings
    ts = nnx.merge(graphdef, new_state)
    assert int(ts.step) == 1 and ts.optimizer.step[...].sharding.is_fully_replicated

    # The moments, linear in the gradient, agree to fp32 roundoff of its sharded reductions
    # (measured <= 8e-7 of the largest entry). The update lr * g / (|g| + eps) amplifies a
    # gradient error dg up to lr * dg / eps, i.e. (max |g| / eps) x that relative roundoff
    # (measured 1.6e-5): it gets 1e-4. A real error (a missed shard, a wrong sum) is O(1).
    def close(actual, expected, rtol):
        actual, expected = np.asarray(actual), np.asarray(expected)
        scale = np.max(np.abs(expected))
        assert scale > 0
        assert np.max(np.abs(actual - expected)) <= rtol * scale

    deltas = jax.tree.map(lambda new, old: np.asarray(new) - old, _params(ts), initial)
    ref_deltas = jax.tree.map(lambda new, old: np.asarray(new) - old, _params(reference), initial)
    jax.tree.map(functools.partial(close, rtol=1e-4), deltas, ref_deltas)
    for name in ("mu", "nu"):
        jax.tree.map(functools.partial(close, rtol=1e-5), _moments(ts, name),
                     _moments(reference, name))


def test_weight_decay_reaches_only_matrices():
    # Zero gradients: the update is the decoupled decay alone, p <- p * (1 - lr * wd).
    graphdef, state = nnx.split(_fresh())
    before = jax.tree.map(np.asarray, _params(nnx.merge(graphdef, state)))

    @jax.jit
    def zero_gradient_step(state):
        ts = nnx.merge(graphdef, state)
        ts.apply_gradients(jax.tree.map(jnp.zeros_like, _params(ts)))
        return nnx.state(ts)

    ts = nnx.merge(graphdef, zero_gradient_step(state))
    factor = 1 - OPTIM.lr * OPTIM.weight_decay
    decayed = []
    for path, new in jax.tree_util.tree_leaves_with_path(_params(ts)):
        old = np.asarray(functools.reduce(lambda s, k: s[k.key], path[:-1], before)[...])
        name = jax.tree_util.keystr(path)
        if "['scale']" in name or "_bias']" in name:
            np.testing.assert_array_equal(new, old, err_msg=name)
        else:
            np.testing.assert_allclose(new, old * factor, rtol=1e-6, err_msg=name)
            decayed.append(name)
    # The (tied) embedding and the stacked layers' qkv, o, gate_up and down kernels.
    assert "['embed'].value" in decayed[0] and len(decayed) == 5


def test_reference_params_are_a_copy_that_outlives_a_donating_step():
    ts = _fresh()
    ref = reference_params(ts)
    params = _params(ts)
    for r, p in zip(jax.tree.leaves(ref), jax.tree.leaves(params), strict=True):
        assert r.sharding == p.sharding
    initial = jax.tree.map(np.asarray, params)
    graphdef, state = nnx.split(ts)
    jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    jax.tree.map(np.testing.assert_array_equal, ref, initial)
    # It runs as the model it was copied from.
    model = nnx.merge(nnx.graphdef(ts.model), ref)
    ids, mask = _batch()
    assert np.isfinite(float(_loss(model, ids, mask)))


# ------------------------------------------------------------------ train_state_from_model

# Stacked layers: a stacked norm scale [layers, embed] is 2-D but not decayed, so a wrong
# decay mask (e.g. "every 2-D array") shows in the zero-gradient update.
LLAMA = make_tiny_config("llama", scan_layers=True)


def _llama():
    return Transformer(LLAMA, rngs=nnx.Rngs(0))


def _zero_gradient_step(ts: TrainState) -> TrainState:
    """One update with zero gradients: the decoupled decay of the masked params alone."""
    graphdef, state = nnx.split(ts)

    @jax.jit
    def step(state):
        ts = nnx.merge(graphdef, state)
        ts.apply_gradients(jax.tree.map(jnp.zeros_like, _params(ts)))
        return nnx.state(ts)

    return nnx.merge(graphdef, step(state))


def _check_from_model(model, mesh, rules, rtol):
    """The state around `model`: its values, zero moments, `state_shardings` placement, step 0;
    ≡ `create_train_state` from the same seed, to `rtol` (0: bit for bit)."""
    original = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))  # the model is donated
    ts = train_state_from_model(model, OPTIM, mesh, rules)
    # Placed as the state wants them, the model's buffers are reused, not copied.
    assert all(x.is_deleted() for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert int(ts.step) == 0
    params = _params(ts)
    jax.tree.map(np.testing.assert_array_equal, params, original)

    expected = state_shardings(nnx.state(ts), mesh, rules)
    actual = jax.tree.map(lambda x: x.sharding, nnx.state(ts))
    assert jax.tree.leaves(actual) == jax.tree.leaves(expected)
    # Not vacuous: the fsdp rules split the parameters over all 8 devices.
    assert params["embed"].sharding.spec == P(None, "fsdp")
    assert params["embed"].sharding.shard_shape(params["embed"].shape) == (
        LLAMA.vocab_size, LLAMA.hidden_size // 8)
    for name in ("mu", "nu"):
        moments = _moments(ts, name)
        for m, p in zip(jax.tree.leaves(moments), jax.tree.leaves(params), strict=True):
            assert m.shape == p.shape and m.dtype == p.dtype and m.sharding == p.sharding
            np.testing.assert_array_equal(m, np.zeros(m.shape, m.dtype))

    created = create_train_state(_llama, OPTIM, mesh, rules)
    same = functools.partial(np.testing.assert_allclose, rtol=rtol, atol=0)
    jax.tree.map(same, _params(created), original)
    assert (jax.tree.structure(nnx.state(created.optimizer))
            == jax.tree.structure(nnx.state(ts.optimizer)))
    assert (jax.tree.map(lambda x: x.sharding, nnx.state(created))
            == jax.tree.map(lambda x: x.sharding, nnx.state(ts)))
    # The same optimizer, decay mask included: a zero-gradient update multiplies the matrices
    # by 1 - lr * wd = 0.999 in both (a wrong mask would be off by 1e-3, far above rtol).
    jax.tree.map(same, _params(_zero_gradient_step(ts)), _params(_zero_gradient_step(created)))


def _fsdp():
    layout = load_layout("fsdp")
    mesh = make_mesh(layout)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    return mesh, layout.train_rules


def test_train_state_from_a_resharded_model_matches_a_created_one():
    mesh, rules = _fsdp()
    model = _llama()
    reshard(model, mesh, rules)
    # Built eagerly, the initialisers round differently from the jitted creation: <= 1 ulp
    # (measured 2e-7 relative).
    _check_from_model(model, mesh, rules, rtol=1e-6)


def test_train_state_from_a_model_created_sharded_matches_a_created_one():
    mesh, rules = _fsdp()
    _check_from_model(create_sharded(_llama, mesh, rules), mesh, rules, rtol=0)
