"""Logical-axis rules: PartitionSpecs worked out by hand, constraints, sharded creation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.models import Transformer
from jaxrl.sharding import (
    AxisRules,
    constrain,
    create_sharded,
    load_layout,
    make_mesh,
    reshard,
    use_rules,
)
from jaxrl.sharding.layout import Layout, MeshAxes
from jaxrl.sharding.rules import active_rules, variable_axes
from tests.conftest import make_tiny_config

RULES = AxisRules.from_mapping({
    "batch": ["data", "fsdp"], "vocab": "tensor", "embed": "fsdp", "heads": "tensor",
    "kv_heads": "tensor", "mlp": ["tensor", "fsdp"], "head_dim": None,
    "act_embed": None, "act_vocab": "tensor",
})


def _mesh(data, fsdp, tensor):
    return make_mesh(Layout("test", MeshAxes(data, fsdp, tensor), 1, RULES, RULES))


@pytest.mark.parametrize("mesh_shape, axes, shape, expected", [
    # Batch over two mesh axes; trailing replicated dimensions are dropped from the spec.
    ((2, 2, 2), ("batch", "seq", "act_embed"), (8, 12, 32), P(("data", "fsdp"))),
    ((2, 2, 2), ("batch", "seq", "act_vocab"), (8, 12, 96), P(("data", "fsdp"), None, "tensor")),
    # 2 rows do not divide data x fsdp = 4: the trailing mesh axis is dropped.
    ((2, 2, 2), ("batch", "seq"), (2, 12), P("data")),
    # 3 rows divide neither: replicated.
    ((2, 2, 2), ("batch", "seq"), (3, 12), P()),
    # Size-1 mesh axes are left out of the spec.
    ((1, 8, 1), ("batch", "seq"), (8, 12), P("fsdp")),
    ((8, 1, 1), ("batch", "seq"), (8, 12), P("data")),
    # 2 kv heads on a 4-way tensor axis: replicated over tensor, embed still on fsdp.
    ((1, 2, 4), ("embed", "kv_heads", "head_dim"), (32, 2, 8), P("fsdp")),
    ((1, 2, 4), ("embed", "heads", "head_dim"), (32, 4, 8), P("fsdp", "tensor")),
    # A mesh axis is used once per array: `mlp` asks for (tensor, fsdp) but embed took fsdp.
    ((1, 4, 2), ("embed", "mlp"), (32, 64), P("fsdp", "tensor")),
    ((1, 4, 2), ("mlp", "embed"), (64, 32), P(("tensor", "fsdp"))),
    # Logical None and axes without a rule are replicated.
    ((1, 4, 2), (None, "layers", "embed"), (4, 2, 32), P(None, None, "fsdp")),
])
def test_spec_worked_examples(mesh_shape, axes, shape, expected):
    assert RULES.spec(axes, shape, _mesh(*mesh_shape)) == expected


def test_spec_never_uses_a_mesh_axis_twice_and_always_divides():
    mesh = _mesh(2, 2, 2)
    for axes in [("batch", "embed"), ("embed", "batch"), ("mlp", "embed", "batch")]:
        for shape in [(8, 8, 8), (2, 4, 6), (6, 4, 2), (1, 3, 5)]:
            spec = RULES.spec(axes, shape[:len(axes)], mesh)
            used = [a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))]
            assert len(used) == len(set(used))
            for size, entry in zip(shape, spec, strict=False):
                names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
                assert size % int(np.prod([mesh.shape[a] for a in names])) == 0


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="unknown logical axis 'btach'"):
        AxisRules.from_mapping({"btach": "data"})
    with pytest.raises(ValueError, match="names mesh axis 'model'.*data, fsdp, tensor"):
        AxisRules.from_mapping({"batch": ["data", "model"]})
    # A typo in model code must not silently replicate.
    with pytest.raises(ValueError, match="unknown logical axis 'btach'"):
        RULES.spec(("btach", "seq"), (8, 12), _mesh(2, 2, 2))
    with pytest.raises(ValueError, match="do not match shape"):
        RULES.spec(("batch",), (8, 12), _mesh(2, 2, 2))


def test_constrain_is_a_noop_outside_use_rules():
    assert active_rules() is None
    x = jnp.ones((8, 32))
    f = lambda x: constrain(x * 2, ("batch", "act_embed"))  # noqa: E731
    assert "sharding_constraint" not in str(jax.make_jaxpr(f)(x))
    np.testing.assert_array_equal(jax.jit(f)(x), 2 * np.ones((8, 32)))


def test_constrain_applies_the_rules_inside_use_rules():
    mesh = _mesh(2, 2, 2)
    x = jax.device_put(jnp.ones((8, 96)), NamedSharding(mesh, P()))
    with use_rules(mesh, RULES):
        assert active_rules() == (mesh, RULES)
        y = jax.jit(lambda x: constrain(x * 2, ("batch", "act_vocab")))(x)
    assert active_rules() is None
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp"), "tensor")), 2)
    assert y.addressable_shards[0].data.shape == (2, 48)
    np.testing.assert_array_equal(y, 2 * np.ones((8, 96)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_create_sharded_places_every_param_per_the_rules(scan_layers):
    layout = load_layout("fsdp_tp")
    mesh, rules = make_mesh(layout), layout.train_rules
    config = make_tiny_config("llama", scan_layers=scan_layers)
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, rules)
    variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))
    # embed, lm_head, final norm + per layer: 2 norms, qkv, o, gate_up, down (2 layers).
    assert len(variables) == (15 if not scan_layers else 9)
    for variable in variables:
        value = variable[...]
        spec = rules.spec(variable_axes(variable), value.shape, mesh)
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim)
        # Every llama parameter has an `embed` dimension (fsdp), so none may stay whole on
        # any device.
        assert "fsdp" in jax.tree.leaves(tuple(spec))
        assert len(value.sharding.device_set) == 8
        assert all(s.data.size < value.size for s in value.addressable_shards)


def test_reshard_moves_train_layout_to_rollout_layout_without_changing_values():
    layout = load_layout("fsdp_tp")
    mesh = make_mesh(layout)
    config = make_tiny_config("qwen3")
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(0)), mesh, layout.train_rules)
    before = jax.tree.map(np.asarray, nnx.state(model))
    reshard(model, mesh, layout.rollout_rules)
    after = nnx.state(model)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, after))
    for variable in jax.tree.leaves(after, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        value = variable[...]
        spec = layout.rollout_rules.spec(variable_axes(variable), value.shape, mesh)
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim)
        assert "fsdp" not in jax.tree.leaves(tuple(spec))
