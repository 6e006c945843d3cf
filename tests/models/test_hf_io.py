"""HF interop: parity with transformers, save/load round trips, sharded loading, clear errors."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import AxisType, PartitionSpec
from safetensors.numpy import load_file, save_file

from jaxrl.models import (
    CheckpointError,
    UnsupportedModelError,
    default_positions,
    from_pretrained,
    hf_io,
    save_pretrained,
)
from jaxrl.sharding import AxisRules
from tests.conftest import FAMILIES, make_tiny_config

LENGTHS = (12, 9, 5)  # left-padded rows; pad token 0


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """Factory: the directory of a random-init HF model of `family`, saved by transformers."""
    made = {}

    def make(family, torch_dtype=torch.float32):
        key = (family, torch_dtype)
        if key not in made:
            model = _hf_model(family)
            path = tmp_path_factory.mktemp(f"hf_{family}_{str(torch_dtype)[6:]}")
            model.to(torch_dtype).save_pretrained(path, safe_serialization=True)
            made[key] = path
        return made[key]

    return make


def _hf_model(family):
    hf = make_tiny_config(family).to_hf()
    config = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # The default init (std 0.02, unit norms) gives near-uniform logits, which would make the
    # relative tolerance meaningless; use larger weights and non-trivial norm scales.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def _batch(vocab_size):
    rng = np.random.default_rng(0)
    t = max(LENGTHS)
    mask = np.array([[i >= t - n for i in range(t)] for n in LENGTHS])
    ids = np.where(mask, rng.integers(1, vocab_size, (len(LENGTHS), t)), 0)
    return ids.astype(np.int32), mask


def _our_logits(model, ids, mask):
    return np.asarray(model(ids, default_positions(mask), mask))


def _hf_logits(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def _assert_close(ours, ref, mask):
    ours, ref = ours[mask], ref[mask]  # padded positions are garbage by contract
    scale = np.abs(ref).max()
    assert ref.std() > 0.5, "logits are near-uniform: the comparison would be vacuous"
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4 * scale)


def _params(model):
    return {p: np.asarray(jax.device_get(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert pa[key].dtype == pb[key].dtype, key
        np.testing.assert_array_equal(pa[key], pb[key], err_msg=str(key))


# ------------------------------------------------------------------ parity with transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, hf_checkpoint):
    path = hf_checkpoint(family)
    ours = from_pretrained(path)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids, mask = _batch(ours.config.vocab_size)
    assert ours.config == make_tiny_config(family)
    _assert_close(_our_logits(ours, ids, mask), _hf_logits(ref_model, ids, mask), mask)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied, untied
def test_save_pretrained_loads_in_transformers(family, hf_checkpoint, tmp_path):
    ours = from_pretrained(hf_checkpoint(family))
    save_pretrained(ours, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    tensors = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in tensors) == (family == "llama")

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids, mask = _batch(ours.config.vocab_size)
    _assert_close(_our_logits(ours, ids, mask), _hf_logits(ref_model, ids, mask), mask)
    _assert_same_params(ours, from_pretrained(tmp_path))


def test_sharded_save_round_trip(hf_checkpoint, tmp_path):
    ours = from_pretrained(hf_checkpoint("llama"))
    (tmp_path / "model.safetensors").write_bytes(b"stale")  # an earlier save must not survive
    save_pretrained(ours, tmp_path, max_shard_bytes=16 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.glob("model-*.safetensors")) == files
    assert index["metadata"]["total_size"] == 4 * ours.config.num_params()

    _assert_same_params(ours, from_pretrained(tmp_path))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids, mask = _batch(ours.config.vocab_size)
    _assert_close(_our_logits(ours, ids, mask), _hf_logits(ref_model, ids, mask), mask)


# ------------------------------------------------------------------ layouts and dtypes


def _mesh_and_rules():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rules = AxisRules.from_mapping({"batch": ["data", "fsdp"], "embed": "fsdp", "vocab": "tensor",
                                    "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"})
    return mesh, rules


@pytest.mark.parametrize("scan_layers", [False, True])
def test_load_onto_mesh_matches_unsharded(scan_layers, hf_checkpoint):
    path = hf_checkpoint("llama")
    mesh, rules = _mesh_and_rules()
    sharded = from_pretrained(path, mesh=mesh, rules=rules, scan_layers=scan_layers)
    state = nnx.state(sharded, nnx.Param)
    layer = state["layers"] if scan_layers else state["layers"][0]
    lead = (None,) if scan_layers else ()  # the stacked `layers` axis is not sharded
    expected = {
        "embed": (state["embed"], PartitionSpec("tensor", "fsdp")),
        "lm_head": (state["lm_head"], PartitionSpec("fsdp", "tensor")),
        "qkv_kernel": (layer["attn"]["qkv_kernel"], PartitionSpec(*lead, "fsdp", "tensor")),
        "gate_up": (layer["mlp"]["gate_up"], PartitionSpec(*lead, "fsdp", None, "tensor")),
        "o_kernel": (layer["attn"]["o_kernel"], PartitionSpec(*lead, "tensor", None, "fsdp")),
        "down": (layer["mlp"]["down"], PartitionSpec(*lead, "tensor", "fsdp")),
        "final_norm": (state["final_norm"]["scale"], PartitionSpec("fsdp")),
    }
    for name, (variable, spec) in expected.items():
        sharding = variable.get_value().sharding
        assert sharding.mesh == mesh and sharding.spec == spec, name
    for _, variable in nnx.to_flat_state(state):  # every parameter spans the whole mesh
        assert len(variable.get_value().sharding.device_set) == 8

    plain = from_pretrained(path)
    assert plain.embed.get_value().sharding.device_set == {jax.devices()[0]}
    ids, mask = _batch(plain.config.vocab_size)
    want = _our_logits(plain, ids, mask)
    np.testing.assert_allclose(_our_logits(sharded, ids, mask)[mask], want[mask],
                               rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if not scan_layers:
        _assert_same_params(plain, sharded)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
def test_every_slice_reads_the_right_values(family, scan_layers, hf_checkpoint):
    # Shard head_dim and the stacked layer axis too, so every slicing path of the loader runs.
    mesh, _ = _mesh_and_rules()
    rules = AxisRules.from_mapping({"vocab": "fsdp", "embed": "tensor", "heads": "data",
                                    "kv_heads": "data", "head_dim": "fsdp", "mlp": "data",
                                    "layers": "tensor"})
    path = hf_checkpoint(family)
    sharded = from_pretrained(path, mesh=mesh, rules=rules, scan_layers=scan_layers)
    layer = sharded.layers if scan_layers else sharded.layers[0]
    lead = ("tensor", None) if scan_layers else ("tensor",)
    assert layer.attn.qkv_kernel.get_value().sharding.spec == PartitionSpec(
        *lead, "data", None, "fsdp")
    assert layer.mlp.gate_up.get_value().sharding.spec == PartitionSpec(*lead, None, "data")
    _assert_same_params(from_pretrained(path, scan_layers=scan_layers), sharded)


def test_each_distinct_slice_is_read_once(hf_checkpoint, monkeypatch):
    # Weights on `tensor` only (as rollout rules are): each slice is replicated over the
    # 4 data x fsdp devices, and the stacked layers make one parameter read every layer.
    mesh, _ = _mesh_and_rules()
    rules = AxisRules.from_mapping({"vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
                                    "mlp": "tensor"})
    reads = []
    read = hf_io._Checkpoint.read

    def counting_read(self, name, index):
        reads.append((name, tuple((s.start, s.stop) for s in index)))
        return read(self, name, index)

    monkeypatch.setattr(hf_io._Checkpoint, "read", counting_read)
    path = hf_checkpoint("llama")
    sharded = from_pretrained(path, mesh=mesh, rules=rules, scan_layers=True)
    assert len(sharded.layers.mlp.down.get_value().sharding.device_set) == 8
    assert sorted({name for name, _ in reads}) == sorted(load_file(path / "model.safetensors"))
    assert len(reads) == len(set(reads)), "a slice was read more than once"
    monkeypatch.undo()
    _assert_same_params(from_pretrained(path, scan_layers=True), sharded)


def test_scan_layers_round_trip(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen3")
    scanned = from_pretrained(path, scan_layers=True)
    # [layers, E, K, G + 2, H]: 2 kv heads, each with its 2 query heads, key and value.
    assert scanned.layers.attn.qkv_kernel.get_value().shape == (2, 32, 2, 4, 16)
    save_pretrained(scanned, tmp_path)
    assert load_file(tmp_path / "model.safetensors").keys() == load_file(
        hf_checkpoint("qwen3") / "model.safetensors").keys()
    _assert_same_params(from_pretrained(path), from_pretrained(tmp_path))


def test_bfloat16_checkpoint_keeps_its_dtype(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen2", torch.bfloat16)
    model = from_pretrained(path)
    assert model.config.param_dtype == "bfloat16" and model.config.compute_dtype == "bfloat16"
    params = _params(model)
    assert all(v.dtype == jax.numpy.bfloat16 for v in params.values())
    ref = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(params[("embed",)], ref)

    upcast = from_pretrained(path, dtype="float32", compute_dtype=jax.numpy.bfloat16)
    assert upcast.embed.get_value().dtype == np.float32 and upcast.config.compute_dtype == "bfloat16"
    save_pretrained(model, tmp_path)
    assert load_file(tmp_path / "model.safetensors")["model.norm.weight"].dtype == ref.dtype
    _assert_same_params(model, from_pretrained(tmp_path))


# ------------------------------------------------------------------ errors


def _copy(hf_checkpoint, tmp_path, family="llama"):
    path = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint(family), path)
    return path


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        from_pretrained(tmp_path / "nowhere")


def test_missing_config(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(path)


def test_unsupported_model_type(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama"):
        from_pretrained(path)


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": None}, ["config.json"]),
    ({"num_attention_heads": 3}, ["config.json", "num_heads (3)"]),
    ({"torch_dtype": "int8", "dtype": "int8"}, ["config.json", "int8"]),
    ({"num_hidden_layers": "__delete__"}, ["config.json", "num_hidden_layers"]),
])
def test_malformed_config_is_a_checkpoint_error(change, words, hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        if value == "__delete__":
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_save_refused_leaves_the_directory_untouched(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    model = from_pretrained(path)
    # A qwen2 checkpoint without q/k/v bias cannot be written as qwen2.
    model.config = model.config.__class__(**{**model.config.__dict__, "model_type": "qwen2",
                                             "qkv_bias": False, "o_bias": False})
    with pytest.raises(UnsupportedModelError):
        save_pretrained(model, path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_missing_tensor(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError,
                       match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing.*model\.safetensors"):
        from_pretrained(path)


def test_shape_mismatch(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError,
                       match=r"k_proj\.weight'.*shape \(8, 32\).*shape \(16, 32\)"):
        from_pretrained(path)


def test_mesh_without_rules(hf_checkpoint):
    mesh, _ = _mesh_and_rules()
    with pytest.raises(ValueError, match="rules="):
        from_pretrained(hf_checkpoint("llama"), mesh=mesh)


def test_unused_tensors_are_ignored(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint, tmp_path, family="qwen2")  # tied: lm_head.weight is unused
    tensors = load_file(path / "model.safetensors")
    extra = {"lm_head.weight": tensors["model.embed_tokens.weight"] + 1,
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    _assert_same_params(from_pretrained(hf_checkpoint("qwen2")), from_pretrained(path))
