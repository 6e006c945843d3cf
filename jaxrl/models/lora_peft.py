"""A model's LoRA adapters as a PEFT adapter directory (what `peft.PeftModel.from_pretrained`
loads onto the HF base model):

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, ...
    adapter_model.safetensors    base_model.model.model.layers.N.<parent>.<module>.lora_A.weight [r, in]
                                 base_model.model.model.layers.N.<parent>.<module>.lora_B.weight [out, r]

Ours are A [in..., r] and B [r, out...] in the kernels' head-split axes (`jaxrl.models.lora`);
flattening in..., out... gives HF's row order (q: query head k·G + g, as `hf_names` fuses it),
so PEFT's tensors are the flattened transposes and the update s · B_hf A_hf is the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxrl.models.lora_config import HF_PARENT

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_tensors(model: nnx.Module) -> dict[str, np.ndarray]:
    """PEFT's state dict of `model`'s adapters (per layer, HF names and layouts)."""
    stacked = model.config.scan_layers
    tensors = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        # (layers, i, attn|mlp, lora, module, a|b), without i when the layers are stacked
        module, which = path[-2], path[-1]
        x = np.asarray(jax.device_get(variable.get_value()))
        per_layer = enumerate(x) if stacked else [(path[1], x)]
        for layer, value in per_layer:
            r = value.shape[-1] if which == "a" else value.shape[0]
            name = (f"base_model.model.model.layers.{layer}.{HF_PARENT[module]}.{module}."
                    f"lora_{'A' if which == 'a' else 'B'}.weight")
            hf = value.reshape(-1, r).T if which == "a" else value.reshape(r, -1).T
            tensors[name] = np.ascontiguousarray(hf)
    return tensors


def save_peft_adapter(model: nnx.Module, path: str | Path, base_model: str) -> list[str]:
    """Writes `model`'s adapters to `path` for the HF base at `base_model`; returns the files."""
    lora = model.config.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters (model.lora is null): export the "
                         "full model instead")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(model.config.param_dtype) if model.config.param_dtype != "bfloat16" \
        else np.float32  # safetensors.numpy has no bfloat16: widen, exactly
    tensors = {k: v.astype(dtype) for k, v in peft_tensors(model).items()}
    save_file(tensors, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(lora.targets), "fan_in_fan_out": False, "use_rslora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
