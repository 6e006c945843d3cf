"""Rollout engine on a mesh: sharded ≡ single device, weights resharded once inside the program."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from jaxrl.models import Transformer
from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams
from jaxrl.sharding import AxisRules, create_sharded, state_shardings
from jaxrl.sharding.rules import variable_axes
from tests.conftest import make_tiny_config

ROLLOUT_RULES = {
    "batch": ["data", "fsdp"], "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
    "mlp": "tensor", "act_heads": "tensor", "act_kv_heads": "tensor", "act_mlp": "tensor",
    "act_vocab": "tensor",
}
ROLLOUT = AxisRules.from_mapping(ROLLOUT_RULES)
TRAIN = AxisRules.from_mapping({**ROLLOUT_RULES, "embed": "fsdp"})
CONFIG = make_tiny_config("llama")
# Top-k and top-p too, so that sorting and masking a tensor-sharded vocab is covered.
SAMPLER = SamplerConfig(max_new_tokens=8, num_generations=2,
                        sampling=SamplingParams(0.7, top_k=20, top_p=0.95))
PROMPT_LENGTHS = (6, 3, 5, 2)  # 4 prompts x 2 generations: 8 rows


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def _prompts():
    rng = np.random.default_rng(1)
    width = max(PROMPT_LENGTHS)
    mask = np.arange(width)[None, :] >= width - np.asarray(PROMPT_LENGTHS)[:, None]
    ids = np.where(mask, rng.integers(2, CONFIG.vocab_size, (len(PROMPT_LENGTHS), width)), 0)
    return Prompts(jnp.asarray(ids, jnp.int32), jnp.asarray(mask))


def _sharpen(path, x):
    # As in test_sampler: larger layer weights and 20x logits, so tokens depend on context.
    if path[0].key == "final_norm":
        return x * 20.0
    return x * 5.0 if path[0].key == "layers" and path[-1].key != "scale" else x


@functools.cache
def policy(mesh_shape):
    """(mesh, graphdef, state): the policy created straight into the training layout."""
    mesh = _mesh(mesh_shape)
    graphdef, state = nnx.split(
        create_sharded(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)), mesh, TRAIN))
    pure = jax.tree_util.tree_map_with_path(_sharpen, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return mesh, graphdef, state


@functools.cache
def single_device_rollout():
    """The reference: the same weights gathered onto one device, sampled without a mesh."""
    _, graphdef, state = policy((8, 1, 1))
    state = jax.device_put(state, jax.devices()[0])
    return Sampler(graphdef, SAMPLER).generate(state, _prompts(), jax.random.key(0))


def _all_gathers(hlo):
    """(result dims, op_name, whether a while loop runs it) of each all-gather in `hlo`."""
    computations, lines = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) \(.*\{$", line)
        if header:
            lines = computations.setdefault(header.group(1), [])
        elif lines is not None:
            lines.append(line)
    calls = {name: set(re.findall(r"%([\w.\-]+)", "\n".join(body))) & computations.keys()
             for name, body in computations.items()}
    in_loop, todo = set(), [name for body in computations.values() for line in body
                            for name in re.findall(r"\bbody=%([\w.\-]+)", line)]
    while todo:
        name = todo.pop()
        if name not in in_loop:
            in_loop.add(name)
            todo.extend(calls[name])
    gathers = []
    for name, body in computations.items():
        for line in body:
            result = re.search(r"= (.*?) all-gather(?:-start)?\(", line)
            if result:
                op_name = re.search(r'op_name="([^"]*)"', line)
                for dims in re.findall(r"\w+\[([\d,]*)\]", result.group(1)):
                    gathers.append((tuple(int(d) for d in dims.split(",") if d),
                                    op_name.group(1) if op_name else "", name in in_loop))
    return gathers


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_sharded_rollout_matches_single_device(mesh_shape):
    mesh, graphdef, state = policy(mesh_shape)
    # The weights arrive in the training layout (embed over fsdp).
    for variable, expected in zip(jax.tree.leaves(state, is_leaf=_is_variable),
                                  jax.tree.leaves(state_shardings(state, mesh, TRAIN),
                                                  is_leaf=_is_variable), strict=True):
        assert variable[...].sharding.is_equivalent_to(expected.get_value(), variable.ndim)

    sampler = Sampler(graphdef, SAMPLER, mesh=mesh, rules=ROLLOUT)
    rollout = sampler.generate(state, _prompts(), jax.random.key(0))
    reference = single_device_rollout()
    np.testing.assert_array_equal(rollout.completion_ids_BxC, reference.completion_ids_BxC)
    np.testing.assert_array_equal(rollout.completion_mask_BxC, reference.completion_mask_BxC)
    np.testing.assert_allclose(rollout.logp_BxC, reference.logp_BxC, atol=1e-5)
    np.testing.assert_allclose(rollout.logp_raw_BxC, reference.logp_raw_BxC, atol=1e-5)
    assert int(rollout.num_steps) == int(reference.num_steps)

    # Every per-row output is split over the batch mesh axes (data x fsdp), not replicated.
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    for x in (rollout.prompt_ids_BxP, rollout.prompt_mask_BxP, rollout.completion_ids_BxC,
              rollout.completion_mask_BxC, rollout.logp_BxC, rollout.logp_raw_BxC):
        assert x.sharding.shard_shape(x.shape)[0] == x.shape[0] // batch_shards

    # The compiled program (cached, not recompiled) gathers the weights from the training to
    # the rollout layout in the engine's reshard, before the decode loop, and never per token.
    # On CPU, XLA would also hoist per-matmul weight gathers out of the loop if the engine did
    # not reshard; the op names tell the two apart (those would sit under "while/body").
    hlo = sampler._generate.lower(state, _prompts(), jax.random.key(0)).compile().as_text()
    weight_shapes = {ROLLOUT.sharding(variable_axes(v), v.shape, mesh).shard_shape(v.shape)
                     for v in jax.tree.leaves(state, is_leaf=_is_variable)}
    weight_gathers = [g for g in _all_gathers(hlo) if g[0] in weight_shapes]
    assert all(not in_loop and "while" not in op_name
               for _, op_name, in_loop in weight_gathers), weight_gathers
    # The training layout shards weights over fsdp; the rollout layout does not.
    assert bool(weight_gathers) == (mesh.shape["fsdp"] > 1)
    # Sampling runs per device on its own rows: no device gathers other rows' logits (an
    # all-gather with all B rows and more than one shard's vocabulary).
    rows = rollout.completion_ids_BxC.shape[0]
    vocab_shard = CONFIG.vocab_size // mesh.shape["tensor"]
    row_gathers = [g for g in _all_gathers(hlo)
                   if len(g[0]) == 2 and g[0][0] == rows and g[0][1] >= vocab_shard]
    assert not row_gathers, row_gathers


def _is_variable(x):
    return isinstance(x, nnx.Variable)
