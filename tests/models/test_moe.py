"""Mixture of experts: router and dispatch against a per-token loop, the load-balancing loss
against transformers and against numbers worked out by hand, HF round trips, sharded loading
by expert, unsupported configs refused by field."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import AxisType, PartitionSpec
from safetensors.numpy import load_file

from jaxrl.models import (
    ModelConfig,
    Transformer,
    UnsupportedModelError,
    from_pretrained,
    save_pretrained,
)
from jaxrl.models.moe import MoE, dispatch, gather_dispatch, load_balancing_loss, router_stats
from jaxrl.sharding import AxisRules
from tests.conftest import make_tiny_config
from tests.models.test_hf_io import (
    _assert_close,
    _assert_same_params,
    _batch,
    _hf_logits,
    _hf_model,
    _our_logits,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Factory: the directory of a random-init HF MoE model of `family`, saved by transformers."""
    made = {}

    def make(family):
        if family not in made:
            made[family] = tmp_path_factory.mktemp(f"hf_{family}")
            _hf_model(family).save_pretrained(made[family], safe_serialization=True)
        return made[family]

    return make


@pytest.fixture(scope="module")
def moe_checkpoint(checkpoints):
    return checkpoints("qwen3_moe")


def test_dispatch_matches_a_loop_over_tokens_and_their_experts():
    rng = np.random.default_rng(0)
    n, k, x, e, f = 7, 3, 5, 4, 6
    x_NxE = rng.normal(size=(n, e)).astype(np.float32)
    experts_NxK = np.stack([rng.choice(x, k, replace=False) for _ in range(n)]).astype(np.int32)
    weights_NxK = rng.uniform(size=(n, k)).astype(np.float32)
    gate_up = rng.normal(size=(x, e, 2, f)).astype(np.float32)
    down = rng.normal(size=(x, f, e)).astype(np.float32)
    want = np.zeros((n, e), np.float32)
    for i in range(n):
        for j in range(k):
            w = experts_NxK[i, j]
            g, u = x_NxE[i] @ gate_up[w, :, 0], x_NxE[i] @ gate_up[w, :, 1]
            want[i] += weights_NxK[i, j] * ((g / (1 + np.exp(-g)) * u) @ down[w])
    args = tuple(map(jnp.asarray, (x_NxE, weights_NxK, experts_NxK, gate_up, down)))
    np.testing.assert_allclose(np.asarray(dispatch(*args)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gather_dispatch(*args)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_router_is_softmax_top_k_with_optional_renormalisation(norm):
    config = make_tiny_config("qwen3_moe", norm_topk_prob=norm)
    moe = MoE(config, nnx.Rngs(0))
    x_NxE = jax.random.normal(jax.random.key(1), (6, config.hidden_size))
    weights, experts, probs = moe.route(x_NxE)
    logits = np.asarray(x_NxE) @ np.asarray(moe.router[...])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.sort(p, axis=-1)[:, ::-1][:, :2]
    if norm:
        top = top / top.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(probs), p, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(weights), top, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(experts), np.argsort(-p, axis=-1)[:, :2])


def test_load_balancing_loss_by_hand():
    # 2 experts, k=1, 3 tokens of which the last is padding, one layer:
    # token 0 -> e0 (p = [0.7, 0.3]), token 1 -> e1 (p = [0.4, 0.6]).
    probs = jnp.array([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]])
    experts = jnp.array([[0], [1], [0]])
    stats = router_stats(probs, experts, jnp.array([1.0, 1.0, 0.0]))
    np.testing.assert_allclose(np.asarray(stats), [[1, 1], [1.1, 0.9]], rtol=1e-6)
    # f = [1/2, 1/2], P = [0.55, 0.45]: aux = 2 * (0.5 * 0.55 + 0.5 * 0.45) = 1.0
    assert float(load_balancing_loss(stats, 1, jnp.float32(2))) == pytest.approx(1.0)
    # Two layers with the same statistics: f and P are unchanged (averaged over L·N).
    assert float(load_balancing_loss(2 * stats, 2, jnp.float32(2))) == pytest.approx(1.0)


def test_load_balancing_loss_matches_transformers(moe_checkpoint):
    ours = from_pretrained(moe_checkpoint)
    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_checkpoint,
                                                            attn_implementation="eager")
    ids, mask = _batch(ours.config.vocab_size)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = ref(input_ids=torch.tensor(ids, dtype=torch.long),
                  attention_mask=torch.tensor(mask, dtype=torch.long),
                  position_ids=torch.tensor(positions, dtype=torch.long),
                  output_router_logits=True)
    want = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func(
        out.router_logits, ours.config.num_experts, ours.config.num_experts_per_tok,
        torch.tensor(mask, dtype=torch.long)).item()
    _, stats = ours.hidden_states(jnp.asarray(ids), jnp.asarray(mask), router_stats=True)
    got = load_balancing_loss(stats, ours.config.num_layers, jnp.float32(mask.sum()))
    assert want > 0.5
    assert float(got) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("family, scan_layers", [("qwen3_moe", False), ("qwen3_moe", True),
                                                 ("mixtral", True)])
def test_save_load_round_trip_with_transformers(family, scan_layers, checkpoints, tmp_path):
    moe_checkpoint = checkpoints(family)
    ours = from_pretrained(moe_checkpoint, scan_layers=scan_layers)
    save_pretrained(ours, tmp_path)
    # Per-expert tensors, as the hub checkpoints and transformers' own save.
    assert load_file(tmp_path / "model.safetensors").keys() == load_file(
        moe_checkpoint / "model.safetensors").keys()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids, mask = _batch(ours.config.vocab_size)
    _assert_close(_our_logits(ours, ids, mask), _hf_logits(ref, ids, mask), mask)
    _assert_same_params(from_pretrained(moe_checkpoint), from_pretrained(tmp_path))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_load_sharded_by_expert(scan_layers, moe_checkpoint):
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rules = AxisRules.from_mapping({"expert": "fsdp", "embed": "fsdp", "mlp": "tensor",
                                    "vocab": "tensor", "heads": "tensor", "layers": "data"})
    sharded = from_pretrained(moe_checkpoint, mesh=mesh, rules=rules, scan_layers=scan_layers)
    mlp = sharded.layers.mlp if scan_layers else sharded.layers[0].mlp
    lead = ("data",) if scan_layers else ()
    # The expert axis takes fsdp; embed, asking for it second, stays whole.
    assert mlp.gate_up.get_value().sharding.spec == PartitionSpec(*lead, "fsdp", None, None,
                                                                  "tensor")
    assert mlp.down.get_value().sharding.spec == PartitionSpec(*lead, "fsdp", "tensor")
    plain = from_pretrained(moe_checkpoint, scan_layers=scan_layers)
    _assert_same_params(plain, sharded)
    ids, mask = _batch(plain.config.vocab_size)
    want = _our_logits(plain, ids, mask)
    np.testing.assert_allclose(_our_logits(sharded, ids, mask)[mask], want[mask],
                               rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("family, change, field", [
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_unsupported_moe_layouts_are_refused_by_field(family, change, field):
    hf = {**make_tiny_config(family).to_hf(), **change}
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_hf(hf)


def test_config_round_trips_through_config_json():
    config = make_tiny_config("qwen3_moe")
    assert ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config
    hf = transformers.AutoConfig.for_model(**config.to_hf())
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (8, 2, 16)
    mixtral = make_tiny_config("mixtral")
    assert ModelConfig.from_hf(json.loads(json.dumps(mixtral.to_hf()))) == mixtral
    hf = transformers.AutoConfig.for_model(**mixtral.to_hf())
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size) == (4, 2, 16)


def test_active_parameters_count_only_the_routed_experts():
    c = make_tiny_config("qwen3_moe")
    e, f = c.hidden_size, c.moe_intermediate_size
    assert c.mlp_params() == 8 * 3 * e * f + e * 8
    assert c.mlp_params(active=True) == 2 * 3 * e * f + e * 8
    model = nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))
    counted = sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert counted == c.num_params()


@pytest.mark.parametrize("scan_layers, remat", [(False, "block"), (True, "save_dots")])
def test_remat_gives_the_same_loss_and_gradients_with_router_stats(scan_layers, remat):
    ids, mask = (jnp.asarray(a) for a in _batch(96))

    def value_and_grads(remat):
        config = make_tiny_config("qwen3_moe", scan_layers=scan_layers, remat=remat)
        graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))

        def loss(state):
            h, stats = nnx.merge(graphdef, state).hidden_states(ids, mask, router_stats=True)
            aux = load_balancing_loss(stats, config.num_layers, jnp.sum(mask))
            return jnp.sum(jnp.mean(h ** 2, axis=-1) * mask) / jnp.sum(mask) + aux

        return jax.jit(jax.value_and_grad(loss))(state)

    loss, grads = value_and_grads("none")
    loss_remat, grads_remat = value_and_grads(remat)
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-5)
    for (path, g), (_, g_remat) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_remat),
                                       strict=True):
        np.testing.assert_allclose(g_remat[...], g[...], rtol=1e-5, atol=1e-6, err_msg=str(path))
    router = nnx.to_flat_state(grads)
    assert any(np.any(g[...] != 0) for p, g in router if "router" in p)
