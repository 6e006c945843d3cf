"""`jaxrl export RUN_DIR [--step N] --out DIR`: a checkpoint's policy as a Hugging Face directory.

    config.yaml of the run     -> the policy's architecture and dtypes
    model.path (or init_model) -> the model skeleton and the tokenizer
    checkpoint N (newest)      -> the parameters, restored onto one device
    --out DIR                  <- model.safetensors (+ index when sharded), config.json,
                                  generation_config.json, tokenizer files

The result loads in transformers (`AutoModelForCausalLM`'s `from_pretrained` of DIR) and in
`jaxrl.models.load_policy`, with the checkpoint's exact parameter values (a LoRA run's as
its merged weights, W + s · A B). `--out` must be a new or empty directory: an export never
overwrites a model.

`--adapter` (LoRA runs): the adapters alone as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors; `jaxrl.models.lora_peft`) for the run's base model, which
`peft.PeftModel`'s `from_pretrained` loads onto the base model as transformers loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from jaxrl.config import ConfigError
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.models import save_pretrained
from jaxrl.models.lora_peft import save_peft_adapter
from jaxrl.saved.policy import load_run_policy


def run_export(run_dir: str | Path, out: str | Path, console: Console, *,
               step: int | None = None, adapter: bool = False) -> dict[str, Any]:
    """Writes checkpoint `step` (default: the newest) of `run_dir` to `out` (with `adapter`
    its LoRA adapters as a PEFT directory); returns a summary."""
    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory; "
                          f"choose a new one")
    step, model, model_dir = load_run_policy(run_dir, step)
    if adapter:
        if model.config.lora is None:
            raise ConfigError(f"--adapter: {str(run_dir)!r} trained without LoRA (model.lora "
                              f"is null); export the full model without --adapter")
        files = save_peft_adapter(model, out, str(model_dir.resolve()))
        console.print(f"[bold]export[/]: LoRA adapters of step {step} of {run_dir} -> {out} "
                      f"(base {model_dir})")
        return {"run_dir": str(run_dir), "step": step, "out": str(out), "files": files,
                "base_model": str(model_dir.resolve())}
    save_pretrained(model, out)
    load_tokenizer(model_dir).save_pretrained(str(out))
    console.print(f"[bold]export[/]: step {step} of {run_dir} -> {out}")
    return {"run_dir": str(run_dir), "step": step, "out": str(out),
            "num_params": model.config.num_params()}
