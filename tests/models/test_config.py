"""ModelConfig from real-world HF config.json shapes, back to HF, and its parameter count."""

import pytest
from flax import nnx

from jaxrl.models import ModelConfig, RopeScaling, Transformer, UnsupportedModelError
from jaxrl.models.config import tiny_config
from jaxrl.models.layers import rope_inverse_frequencies

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=128)


def test_mistral_without_sliding_window():
    config = ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": None})
    assert config.sliding_window is None and config.head_dim == 8


def test_qwen2_ignores_a_window_it_does_not_use():
    config = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 4096,
                                  "use_sliding_window": False, "rope_theta": 1e6})
    assert config.sliding_window is None and config.qkv_bias and not config.o_bias
    assert config.rope_theta == 1e6


def test_qwen2_with_per_layer_windows_is_refused():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True})


@pytest.mark.parametrize("key, rope", [
    # transformers < 4.56 wrote rope_scaling with `type` or `rope_type` ...
    ("rope_scaling", {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # ... transformers 5 writes rope_parameters, theta included.
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
])
def test_llama3_rope_scaling_in_either_format(key, rope):
    config = ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_theta": 5e5, key: rope})
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    assert config.rope_theta == 5e5


def test_llama3_scaling_divides_low_frequencies_and_keeps_high_ones():
    plain = rope_inverse_frequencies(tiny_config("llama", rope_scaling=None))
    scaled = rope_inverse_frequencies(tiny_config("llama"))
    # Wavelength 2*pi/f: below L/high (= 4) kept; above L/low (= 16) divided by the factor.
    wavelength = 2 * 3.141592653589793 / plain
    assert (scaled[wavelength < 4] == plain[wavelength < 4]).all()
    assert abs(scaled[wavelength > 16] * 8 - plain[wavelength > 16]).max() < 1e-9


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, ["gpt2", "llama, mistral, qwen2, qwen3"]),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["yarn"]),
    ({"model_type": "llama", "mlp_bias": True}, ["mlp_bias"]),
    ({"model_type": "llama", "hidden_act": "gelu"}, ["gelu"]),
])
def test_unsupported_checkpoints_are_named(change, words):
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf({**BASE, **change})
    for word in words:
        assert word in str(info.value)


def test_bad_dimensions_are_named():
    with pytest.raises(ValueError, match="num_heads .3. must be a multiple of num_kv_heads .2."):
        tiny_config("llama", num_heads=3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_hf_round_trip_and_parameter_count(family):
    config = tiny_config(family)
    assert ModelConfig.from_hf(config.to_hf()) == config
    model = Transformer(config, rngs=nnx.Rngs(0))
    counted = sum(v[...].size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert config.num_params() == counted
