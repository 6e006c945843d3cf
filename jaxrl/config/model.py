"""The `model` and `sharding` sections: which policy, in which dtypes, laid out how.

    model.path      a local HF directory; null (training only): a random `model.init` policy
    model.init      the sizes and family of that random policy
    model.lora      LoRA adapters (rank, alpha, target modules); null: full fine-tuning
    sharding.layout a preset name in sharding/, a path to a layout YAML, or `auto`: one
                    device -> `single`, several -> `fsdp` over all of them
    sharding.rollout_devices, rollout_layout   the rollout side of algo.mode=async
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config_base import fail, require_at_least
from jaxrl.models.load_settings import LoadSettings
from jaxrl.models.lora_config import LoraConfig

DType = Literal["float32", "bfloat16", "float16"]
Family = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """`model`: the policy's directory, dtypes and compute choices."""

    path: str | None = None  # a local HF directory (config.json + *.safetensors)
    dtype: DType | None = None  # parameter dtype; None: the checkpoint's own
    compute_dtype: DType | None = None  # None: the parameter dtype
    scan_layers: bool = False
    # The training forward's attention kernel (jaxrl/models/attention_kernels.py): "auto" is
    # cuDNN flash attention on GPU (bf16/fp16), Splash on TPU, XLA on CPU; a kernel named for
    # another platform is an error. The sampler's cached paths always run XLA's attention.
    attention_impl: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    # Activation memory vs FLOPs of the backward pass: "block" keeps only each decoder
    # block's input and recomputes its forward, "save_dots" keeps the weight matmul outputs.
    remat: Literal["none", "block", "save_dots"] = "none"

    def load_settings(self) -> LoadSettings:
        """How the policy loads (`jaxrl.models.hf_io.load_policy`): this section's dtypes and
        compute choices."""
        return LoadSettings(dtype=self.dtype, compute_dtype=self.compute_dtype,
                          scan_layers=self.scan_layers, attention_impl=self.attention_impl,
                          remat=self.remat)


@dataclasses.dataclass(frozen=True)
class InitSection:
    """`model.init`: a random policy made from scratch (when `model.path` is null)."""

    family: Family = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 10_000.0
    vocab_size: int | None = None  # null: the tokenizer's; larger: extra rows (benchmarks)
    # qwen3_moe only: every layer's MLP is num_experts experts of width moe_intermediate_size,
    # num_experts_per_tok of them per token (jaxrl.models.moe).
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    # The token embeddings' init std (the output layer's too when tied); transformers' 0.02.
    # A LoRA run on a random base trains no embedding: at 0.02 its frozen tied output layer
    # caps a logit's lead at ~1.3 (|normed h| = sqrt(E) = 8 times |e_v| = 0.02 sqrt(E) = 0.16),
    # too little for a confident answer; the LoRA quickstart uses 0.1.
    embed_std: float = 0.02

    def __post_init__(self):
        if not self.rope_theta > 0:
            fail("model.init", self, "rope_theta", "> 0")
        if not self.embed_std > 0:
            fail("model.init", self, "embed_std", "> 0")
        require_at_least("model.init", self, ("vocab_size",), note=" or null")
        require_at_least("model.init", self, ("hidden_size", "intermediate_size", "num_layers",
                                               "num_heads", "num_kv_heads"))
        if self.hidden_size % self.num_heads:
            fail("model.init", self, "hidden_size", f"a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            fail("model.init", self, "num_heads",
                 f"a multiple of num_kv_heads={self.num_kv_heads}")
        require_at_least("model.init", self, ("num_experts", "num_experts_per_tok",
                                               "moe_intermediate_size"))
        if self.num_experts_per_tok > self.num_experts:
            fail("model.init", self, "num_experts_per_tok",
                 f"at most num_experts={self.num_experts}")
        if not isinstance(self.norm_topk_prob, bool):
            fail("model.init", self, "norm_topk_prob", "a bool")


@dataclasses.dataclass(frozen=True)
class TrainModelSection(ModelSection):
    """`model` of an experiment: `ModelSection` plus `init` for a random policy (path null)
    and `lora` (null: full fine-tuning)."""

    init: InitSection = dataclasses.field(default_factory=InitSection)
    lora: LoraConfig | None = None  # jaxrl.models.lora_config: its keys and checks

    def load_settings(self) -> LoadSettings:
        """`ModelSection.load_settings` with the run's LoRA adapters."""
        return dataclasses.replace(super().load_settings(), lora=self.lora)


@dataclasses.dataclass(frozen=True)
class ShardingSection:
    """`sharding`: the layout (module docstring)."""

    layout: str = "auto"  # a preset name in sharding/, a layout YAML's path, or auto
    # algo.mode=async only: the devices that generate (a count, or a fraction of all devices,
    # rounded down; jaxrl.sharding.submeshes), laid out by rollout_layout (null: `layout`);
    # the rest train, laid out by `layout`.
    rollout_devices: float = 0.5
    rollout_layout: str | None = None

    def __post_init__(self):
        value = self.rollout_devices
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                value >= 1 and value == int(value) or 0 < value < 1):
            fail("sharding", self, "rollout_devices",
                 "a device count (an integer >= 1) or a fraction of the devices in (0, 1)")

    @property
    def rollout_share(self) -> int | float:
        """`rollout_devices` as `split_devices` reads it: a count as an int (YAML's float
        field holds 4 as 4.0), a fraction as a float."""
        value = self.rollout_devices
        return int(value) if value >= 1 else float(value)
