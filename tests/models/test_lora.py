"""LoRA adapters: a new adapter is the identity; the adapted forward is W + s·A·B (merged ≡ on
the fly, stacked ≡ unstacked layers); only adapters are trainable; the PEFT export loads with
`peft` on the HF base model and gives jaxrl's logits (fp32, 1e-5); config errors name the key."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import peft  # the dev extra's (pyproject.toml): CI runs these tests, never skips them
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.config import ExperimentConfig, load_config
from jaxrl.models import Transformer, from_pretrained, save_pretrained
from jaxrl.models.config import UnsupportedModelError
from jaxrl.models.lora import trainable
from jaxrl.models.lora_config import LORA_MODULES, LoraConfig, match_targets
from jaxrl.models.lora_merge import rollout_view
from jaxrl.models.lora_peft import save_peft_adapter


def _random_adapters(model: nnx.Module, seed: int = 1, std: float = 0.2) -> None:
    """Non-zero B (and new A) so that the adapters change the logits."""
    state = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: std * jax.random.normal(next(keys), x.shape,
                                                                     x.dtype), state))


def _with_lora(config, targets=LORA_MODULES, **kw):
    return dataclasses.replace(config, lora=LoraConfig(4, 8.0, tuple(targets), **kw))


def _ids(config, shape=(2, 7)):
    return jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, shape))


@pytest.mark.parametrize("scan", [False, True])
def test_new_adapters_leave_the_model_and_its_random_init_unchanged(tiny_config, scan):
    config = tiny_config("qwen2", scan_layers=scan, attention_impl="xla")
    base = Transformer(config, rngs=nnx.Rngs(0))
    adapted = Transformer(_with_lora(config), rngs=nnx.Rngs(0, lora=3))
    ids = _ids(config)
    np.testing.assert_array_equal(adapted(ids), base(ids))  # B = 0
    for a, b in zip(jax.tree.leaves(nnx.state(base, nnx.Param)),
                    jax.tree.leaves(nnx.state(adapted, nnx.Not(nnx.LoRAParam))), strict=True):
        np.testing.assert_array_equal(a, b)
    assert trainable(adapted) is nnx.LoRAParam and trainable(base) is nnx.Param


@pytest.mark.parametrize("family, scan, targets", [
    ("qwen2", False, LORA_MODULES), ("llama", True, LORA_MODULES),
    ("qwen3", False, ("k_proj", "o_proj", "up_proj")), ("llama", False, ("q_proj", "down_proj")),
    ("qwen3_moe", True, ("q_proj", "k_proj", "v_proj", "o_proj")),
])
def test_adapted_forward_is_the_merged_weights_forward(tiny_config, family, scan, targets):
    """x W + s (x A) B at every projection ≡ x (W + s A B): on the fly vs merged."""
    config = _with_lora(tiny_config(family, scan_layers=scan, attention_impl="xla"), targets)
    model = Transformer(config, rngs=nnx.Rngs(0))
    _random_adapters(model)
    graphdef, params = nnx.split(model)
    merged_graphdef, merged = rollout_view(graphdef, params)
    assert not jax.tree.leaves(nnx.state(nnx.merge(merged_graphdef, merged), nnx.LoRAParam))
    ids = _ids(config)
    want = model(ids)
    assert float(jnp.abs(want - Transformer(dataclasses.replace(config, lora=None),
                                            rngs=nnx.Rngs(0))(ids)).max()) > 1e-2
    np.testing.assert_allclose(nnx.merge(merged_graphdef, merged)(ids), want, atol=2e-5)
    on_the_fly = dataclasses.replace(config, lora=dataclasses.replace(config.lora,
                                                                      rollout="on_the_fly"))
    otf_graphdef, otf = rollout_view(nnx.graphdef(Transformer(on_the_fly, rngs=nnx.Rngs(0))),
                                     params)
    np.testing.assert_array_equal(nnx.merge(otf_graphdef, otf)(ids), want)


def test_adapters_on_experts_are_refused_by_name(tiny_config):
    """A mixture of experts' MLPs are experts without adapters: targeting them is an error,
    not adapters silently left out."""
    with pytest.raises(UnsupportedModelError, match=r"\['down_proj', 'gate_proj'\] on qwen3_moe"):
        _with_lora(tiny_config("qwen3_moe"), ("q_proj", "gate_proj", "down_proj"))


def test_only_adapters_get_gradients(tiny_config):
    config = _with_lora(tiny_config("llama", attention_impl="xla"), ("q_proj", "gate_proj"))
    model = Transformer(config, rngs=nnx.Rngs(0))
    _random_adapters(model)
    grads = nnx.grad(lambda m: jnp.sum(m(_ids(config)) ** 2),
                     argnums=nnx.DiffState(0, trainable(model)))(model)
    flat = nnx.to_flat_state(grads)
    assert {p[-2:] for p, _ in flat} == {(m, x) for m in ("q_proj", "gate_proj") for x in "ab"}
    assert all("lora" in p and float(jnp.abs(g.get_value()).max()) > 0 for p, g in flat)


@pytest.mark.parametrize("family, scan", [("llama", False), ("qwen2", True)])
def test_peft_export_loads_on_the_hf_base_with_jaxrl_logits(tiny_config, tmp_path, family, scan):
    config = tiny_config(family)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), tmp_path / "base")
    lora = LoraConfig(4, 8.0, LORA_MODULES if family == "llama"
                      else ("q_proj", "v_proj", "o_proj", "down_proj"))
    model = from_pretrained(tmp_path / "base", scan_layers=scan, attention_impl="xla", lora=lora)
    _random_adapters(model)
    save_peft_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", attn_implementation="eager", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    ids = _ids(config)
    with torch.no_grad():
        want = hf(torch.as_tensor(np.asarray(ids))).logits.numpy()
    got = np.asarray(model(ids))
    assert np.abs(got - np.asarray(from_pretrained(tmp_path / "base")(ids))).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_merged_save_pretrained_is_the_adapted_model(tiny_config, tmp_path):
    config = tiny_config("qwen2")
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), tmp_path / "base")
    model = from_pretrained(tmp_path / "base", attention_impl="xla",
                            lora=LoraConfig(2, 4.0, ("q_proj", "up_proj")))
    _random_adapters(model)
    save_pretrained(model, tmp_path / "merged")
    ids = _ids(config)
    np.testing.assert_allclose(from_pretrained(tmp_path / "merged", attention_impl="xla")(ids),
                               model(ids), atol=2e-5)


def test_target_patterns_match_hf_module_names():
    assert match_targets((".*_proj",)) == LORA_MODULES
    assert match_targets(("self_attn\\..*", "down_proj")) == (*LORA_MODULES[:4], "down_proj")
    with pytest.raises(ValueError, match="'qkv' matches none"):
        match_targets(("qkv",))


@pytest.mark.parametrize("override, words", [
    ("model.lora.rank=0", ["model.lora.rank", ">= 1", "0"]),
    ("model.lora.target_modules=[qkv]", ["model.lora.target_modules", "'qkv'"]),
    ("model.lora.dropout=0.1", ["model.lora.dropout", "0.1"]),
    ("model.lora.alpha=0", ["model.lora.alpha", "> 0"]),
])
def test_bad_lora_config_names_the_key(override, words):
    with pytest.raises(Exception) as e:
        load_config(ExperimentConfig, None, [override])
    for word in words:
        assert word in str(e.value), (word, str(e.value))
