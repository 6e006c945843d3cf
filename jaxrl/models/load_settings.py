"""How a policy is loaded from an HF directory (`LoadSettings`): its dtypes and the runtime
choices that are not part of the checkpoint. The config's `model` section converts to one in
one place (`jaxrl.config.model.ModelSection.load_settings`); `jaxrl.models.hf_io.load_policy`
loads a directory with it. A plain frozen type: `jaxrl.config` holds it without importing
the loader."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.models.lora_config import LoraConfig


@dataclasses.dataclass(frozen=True)
class LoadSettings:
    """A policy's load settings. Checked where they are used: the dtypes when read, the
    attention kernel resolved for the mesh's platform (`jaxrl.models.attention_kernels`), the
    rest by `ModelConfig`."""

    dtype: Any = None  # parameter dtype: a name ("bfloat16") or a dtype; None: the checkpoint's
    compute_dtype: Any = None  # None: the parameter dtype
    scan_layers: bool = False  # one stacked parameter per weight, the layers a `jax.lax.scan`
    attention_impl: str = "auto"  # the training forward's kernel: auto, xla, cudnn or splash
    remat: str = "none"  # what the backward recomputes: none, block or save_dots
    lora: LoraConfig | None = None  # new adapters on the loaded base (A from lora.seed, B = 0)
