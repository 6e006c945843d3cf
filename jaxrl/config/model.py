"""The `model` and `sharding` sections: which policy, in which dtypes, laid out how.

    model.path      a local HF directory; null (training only): a random `model.init` policy
    model.init      the sizes and family of that random policy
    sharding.layout a preset name in sharding/, a path to a layout YAML, or `auto`: one
                    device -> `single`, several -> `fsdp` over all of them
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.load import fail, require_at_least

DType = Literal["float32", "bfloat16", "float16"]
Family = Literal["llama", "mistral", "qwen2", "qwen3"]


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

    def __post_init__(self):
        if not self.rope_theta > 0:
            fail("model.init", self, "rope_theta", "> 0")
        require_at_least("model.init", self, ("vocab_size",), note=" or null")
        require_at_least("model.init", self, ("hidden_size", "intermediate_size", "num_layers",
                                               "num_heads", "num_kv_heads"))
        if self.hidden_size % self.num_heads:
            fail("model.init", self, "hidden_size", f"a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            fail("model.init", self, "num_heads",
                 f"a multiple of num_kv_heads={self.num_kv_heads}")


@dataclasses.dataclass(frozen=True)
class TrainModelSection(ModelSection):
    """`model` of an experiment: `ModelSection` plus `init` for a random policy (path null)."""

    init: InitSection = dataclasses.field(default_factory=InitSection)


@dataclasses.dataclass(frozen=True)
class ShardingSection:
    """`sharding`: the layout (module docstring)."""

    layout: str = "auto"  # a preset name in sharding/, a layout YAML's path, or auto
