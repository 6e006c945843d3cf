"""Architecture of a decoder-only transformer, and its translation to and from HF `config.json`.

One frozen dataclass covers the Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Qwen3-MoE and Mixtral
families; they differ only in a few switches (q/k/v bias, q/k RMSNorm, rope scaling, tied
embeddings, and for `qwen3_moe`/`mixtral` a mixture of `num_experts` SwiGLU experts in place
of the MLP, `jaxrl.models.moe`; Mixtral is Mistral's attention with experts whose top-k
weights are always renormalised). Runtime choices
that are not part of the checkpoint (parameter dtype, compute dtype, layer scan, attention
kernel, activation rematerialisation) live here too so one object builds a model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

import jax

from jaxrl.models.attention_kernels import resolve_attention_impl
from jaxrl.models.families import (
    ARCHITECTURES,
    ATTENTION_BIAS_SWITCH_MODEL_TYPES,
    MOE_MODEL_TYPES,
    QK_NORM_MODEL_TYPES,
    QKV_BIAS_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    attention_switches,
)
from jaxrl.models.lora_config import ATTENTION_MODULES, LoraConfig

DTypeName = Literal["float32", "bfloat16", "float16"]
# The attention kernel of the uncached forward (`jaxrl.models.attention_kernels`): "auto" is
# resolved when the config is made, by platform: cuDNN on GPU, Splash on TPU, XLA elsewhere.
AttentionImpl = Literal["auto", "xla", "cudnn", "splash"]
# What the backward pass of each decoder block recomputes instead of reading from memory
# (the policies themselves are in transformer.py): "none" saves every intermediate,
# "block" saves only each block's input and recomputes its whole forward, "save_dots" saves
# the weight matmul outputs and recomputes the cheap rest (norms, RoPE, activations,
# attention scores and softmax).
Remat = Literal["none", "block", "save_dots"]
# How a mixture of experts multiplies tokens by their experts (`jaxrl.models.moe`):
# "ragged_dot" sorts the assignments by expert and runs one `jax.lax.ragged_dot` per
# projection; "gather" gathers each assignment's expert weights ([N·k, E, F]: memory grows
# with the tokens), whose HLO holds exactly the routed experts' FLOPs: the FLOP accounting
# compiles with it (`jaxrl.step.accounting`), since XLA's CPU lowering of ragged_dot is a
# masked dense dot over all experts and is counted so.
MoeDispatch = Literal["ragged_dot", "gather"]


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture jaxrl cannot represent."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture plus the runtime policy (dtypes, scan, attention kernel, remat)."""

    model_type: Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mixture of experts (qwen3_moe, mixtral): every layer's MLP is `num_experts` SwiGLU experts of
    # width `moe_intermediate_size`, `num_experts_per_tok` of them per token; 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    # Runtime policy, not stored in the checkpoint.
    param_dtype: DTypeName = "float32"
    compute_dtype: DTypeName = "float32"
    lora: LoraConfig | None = None  # adapters on the projections (`jaxrl.models.lora`)
    scan_layers: bool = False
    attention_impl: AttentionImpl = "auto"
    remat: Remat = "none"
    moe_dispatch: MoeDispatch = "ragged_dot"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        moe = self.model_type in MOE_MODEL_TYPES
        if moe != (self.num_experts > 0):
            raise UnsupportedModelError(
                f"num_experts={self.num_experts} with model_type {self.model_type!r}: "
                f"expected num_experts > 0 exactly for {' and '.join(MOE_MODEL_TYPES)}")
        if moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                             f"got {self.num_experts_per_tok}")
        if moe and self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got "
                             f"{self.moe_intermediate_size}")
        mlp_targets = [] if self.lora is None else sorted(set(self.lora.targets) - set(ATTENTION_MODULES))
        if moe and mlp_targets:  # the experts have no adapters: they would be silently skipped
            raise UnsupportedModelError(
                f"LoRA targets {mlp_targets} on {self.model_type}, whose MLPs are experts: "
                f"adapters on experts are not supported; target {list(ATTENTION_MODULES)} only")
        if self.remat not in get_args(Remat):
            raise ValueError(f"remat {self.remat!r} is not supported; expected one of "
                             f"{', '.join(map(repr, get_args(Remat)))}")
        if self.moe_dispatch not in get_args(MoeDispatch):
            raise ValueError(f"moe_dispatch {self.moe_dispatch!r} is not supported; expected "
                             f"one of {', '.join(map(repr, get_args(MoeDispatch)))}")
        if self.attention_impl not in get_args(AttentionImpl):
            raise ValueError(f"attention_impl {self.attention_impl!r} is not supported; expected "
                             f"one of {', '.join(map(repr, get_args(AttentionImpl)))}")
        if self.attention_impl == "auto":  # resolved once, for the default backend
            object.__setattr__(self, "attention_impl", resolve_attention_impl(
                "auto", platform=jax.default_backend(), compute_dtype=self.compute_dtype,
                head_dim=self.head_dim))

    def num_params(self) -> int:
        """Parameter count, embeddings included (tied embeddings counted once)."""
        e, d = self.hidden_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += e
        if self.qk_norm:
            attn += 2 * d
        layer = attn + self.mlp_params() + 2 * e
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.num_layers * layer + self.vocab_size * e + head + e

    def mlp_params(self, *, active: bool = False) -> int:
        """Weights of one layer's MLP: 3·E·F dense; X·3·E·F_moe + E·X (router) for a mixture
        of X experts, of which only the k experts a token is routed to are `active`."""
        e = self.hidden_size
        if not self.num_experts:
            return 3 * e * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * 3 * e * self.moe_intermediate_size + e * self.num_experts

    # ---------------------------------------------------------------- HF config.json

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, param_dtype: DTypeName = "float32",
                compute_dtype: DTypeName = "float32", scan_layers: bool = False,
                attention_impl: AttentionImpl = "auto", remat: Remat = "none") -> ModelConfig:
        """Builds a config from a parsed HF `config.json` plus the runtime policy."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported (no family we cover uses it)")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
        moe = {"qwen3_moe": _moe_fields, "mixtral": _mixtral_fields}.get(model_type,
                                                                          lambda hf: {})(hf)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        sliding_window = None
        if model_type in ("mistral", "mixtral"):
            sliding_window = hf.get("sliding_window")
        elif hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{model_type} with use_sliding_window=true (per-layer windows) is not supported"
            )
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **attention_switches(model_type, bool(hf.get("attention_bias", False))),
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_token_ids(hf.get("eos_token_id")),
            **moe,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            scan_layers=scan_layers,
            attention_impl=attention_impl,
            remat=remat,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict that transformers reads back as the same architecture."""
        if self.model_type in QKV_BIAS_MODEL_TYPES and (not self.qkv_bias or self.o_bias):
            raise UnsupportedModelError("qwen2 checkpoints always have q/k/v bias and no o bias")
        if (self.model_type in ATTENTION_BIAS_SWITCH_MODEL_TYPES
                and self.qkv_bias != self.o_bias):
            raise UnsupportedModelError(
                f"{self.model_type} has one attention_bias switch for q/k/v and o; "
                f"got qkv_bias={self.qkv_bias}, o_bias={self.o_bias}"
            )
        if self.qk_norm != (self.model_type in QK_NORM_MODEL_TYPES):
            raise UnsupportedModelError(f"qk_norm={self.qk_norm} cannot be written as {self.model_type}")
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {"rope_type": "llama3", "rope_theta": self.rope_theta,
                               **dataclasses.asdict(self.rope_scaling)}
            hf["rope_scaling"] = dict(rope_parameters)
        hf["rope_parameters"] = rope_parameters
        if self.model_type == "mixtral" and (self.qkv_bias or self.o_bias
                                             or not self.norm_topk_prob):
            raise UnsupportedModelError("mixtral has no attention biases and always "
                                        "renormalises its top-k router weights")
        if self.model_type in ATTENTION_BIAS_SWITCH_MODEL_TYPES:
            hf["attention_bias"] = self.qkv_bias
        if self.model_type in ("mistral", "mixtral"):
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            hf["use_sliding_window"] = False
            hf["sliding_window"] = None
        if self.model_type == "mixtral":
            hf.update(num_local_experts=self.num_experts,
                      num_experts_per_tok=self.num_experts_per_tok,
                      intermediate_size=self.moe_intermediate_size, router_jitter_noise=0.0)
        elif self.num_experts:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size,
                      norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[])
        return hf


def tiny_config(model_type: str, **overrides: Any) -> ModelConfig:
    """A few-thousand-parameter config exercising every switch of `model_type` (smoke runs, tests)."""
    fields: dict[str, Any] = dict(
        model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=128, **attention_switches(model_type),
    )
    if model_type == "llama":
        fields.update(rope_theta=500_000.0, rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16))
    elif model_type == "qwen2":
        fields.update(tie_word_embeddings=True, rope_theta=1_000_000.0)
    elif model_type == "qwen3":
        fields.update(tie_word_embeddings=True, head_dim=16)
    elif model_type == "qwen3_moe":
        fields.update(head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True)
    elif model_type == "mistral":
        fields.update(sliding_window=4)
    elif model_type == "mixtral":
        fields.update(num_experts=4, num_experts_per_tok=2, intermediate_size=16,
                      moe_intermediate_size=16, norm_topk_prob=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe `config.json`; layouts other than "every
    layer is a mixture" (dense layers interleaved) are refused by field."""
    if hf.get("mlp_only_layers"):
        raise UnsupportedModelError(f"qwen3_moe with mlp_only_layers={hf['mlp_only_layers']} "
                                    "(dense layers among the MoE layers) is not supported; "
                                    "expected []")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(f"qwen3_moe with decoder_sparse_step="
                                    f"{hf['decoder_sparse_step']} is not supported; expected 1")
    if hf.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are "
                                    "not supported")
    # transformers writes `num_experts` under its attribute-map alias `num_local_experts`.
    num_experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _mixtral_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a mixtral `config.json` (experts of width
    intermediate_size; top-k weights always renormalised)."""
    if hf.get("router_jitter_noise"):
        raise UnsupportedModelError(f"mixtral with router_jitter_noise="
                                    f"{hf['router_jitter_noise']} is not supported; expected 0")
    return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)


def _token_ids(value: Any) -> int | tuple[int, ...] | None:
    # Lists are unhashable; the config is a static (hashed) attribute of the model.
    return tuple(value) if isinstance(value, list) else value


def _rope_params(hf: dict[str, Any]) -> dict[str, Any] | None:
    # transformers >= 4.56 writes `rope_parameters`; older checkpoints use `rope_scaling`.
    return hf.get("rope_parameters") or hf.get("rope_scaling")


def _rope_theta(hf: dict[str, Any]) -> float:
    params = _rope_params(hf) or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10_000.0)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    params = _rope_params(hf)
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: 'default', 'llama3'"
        )
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
