"""What each supported model family fixes about the architecture, in one place: reading and
writing checkpoints (`ModelConfig.from_hf`, `to_hf`), the tiny test configs (`tiny_config`)
and a run's random `model.init` policy all take it from here.

    qwen2              q/k/v projections have a bias, o has none (config.json says nothing)
    qwen3, qwen3_moe   RMSNorm over each head of q and k (qk_norm)
    the others         one `attention_bias` switch for q/k/v and o (false in every release)
    qwen3_moe, mixtral every layer's MLP is a mixture of experts (`jaxrl.models.moe`)
"""

from __future__ import annotations

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
QKV_BIAS_MODEL_TYPES = ("qwen2",)
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# One config.json `attention_bias` switch for q/k/v and o (written back as one).
ATTENTION_BIAS_SWITCH_MODEL_TYPES = ("llama", "mistral", "qwen3", "qwen3_moe")

# The `architectures` entry of config.json: the transformers class that loads the family.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def attention_switches(model_type: str, attention_bias: bool = False) -> dict[str, bool]:
    """The attention fields of a `ModelConfig` (qkv_bias, o_bias, qk_norm) of `model_type`,
    whose config.json says `attention_bias` (read by the families that have the switch)."""
    if model_type in QKV_BIAS_MODEL_TYPES:
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    return dict(qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=model_type in QK_NORM_MODEL_TYPES)
