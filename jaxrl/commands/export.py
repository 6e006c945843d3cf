"""`jaxrl export RUN_DIR [--step N] --out DIR`: a checkpoint's policy as a Hugging Face directory.

    config.yaml of the run     -> the policy's architecture and dtypes
    model.path (or init_model) -> the model skeleton and the tokenizer
    checkpoint N (newest)      -> the parameters, restored onto one device
    --out DIR                  <- model.safetensors (+ index when sharded), config.json,
                                  generation_config.json, tokenizer files

The result loads in transformers (`AutoModelForCausalLM.from_pretrained(DIR)`) and in
`jaxrl.models.from_pretrained`, with the checkpoint's exact parameter values. `--out` must be a
new or empty directory: an export never overwrites a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx
from rich.console import Console

from jaxrl.config import ConfigError, ExperimentConfig, load_config
from jaxrl.data.tokenizer import load_tokenizer
from jaxrl.models import from_pretrained, save_pretrained
from jaxrl.run.checkpoint import Checkpoints, RestoreError
from jaxrl.run.run_dir import CONFIG_FILE, INIT_MODEL_DIR, MARKER_FILE, is_run_dir


def run_export(run_dir: str | Path, out: str | Path, console: Console, *,
               step: int | None = None) -> dict[str, Any]:
    """Writes checkpoint `step` (default: the newest) of `run_dir` to `out`; returns a summary."""
    run_dir, out = Path(run_dir), Path(out)
    if not (is_run_dir(run_dir) and (run_dir / CONFIG_FILE).is_file()):
        raise ConfigError(f"{str(run_dir)!r} is not a jaxrl run directory (no {MARKER_FILE} "
                          f"and {CONFIG_FILE}); give the train.run_dir of a training run")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory; "
                          f"choose a new one")
    cfg = load_config(ExperimentConfig, run_dir / CONFIG_FILE, saved=True)
    model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / INIT_MODEL_DIR
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"the run's initial model {str(model_dir)!r} (its architecture and "
                          f"tokenizer) is missing")
    # The checkpoint's tree is the one training used: the same dtype and layer stacking.
    model = from_pretrained(model_dir, dtype=cfg.model.dtype,
                            compute_dtype=cfg.model.compute_dtype,
                            scan_layers=cfg.model.scan_layers)
    checkpoints = Checkpoints(run_dir, async_save=False)
    try:
        step, params = checkpoints.restore_model(nnx.state(model), step)
    except RestoreError as e:
        raise ConfigError(str(e)) from None
    finally:
        checkpoints.close()
    nnx.update(model, params)
    save_pretrained(model, out)
    load_tokenizer(model_dir).save_pretrained(str(out))
    console.print(f"[bold]export[/]: step {step} of {run_dir} -> {out}")
    return {"run_dir": str(run_dir), "step": step, "out": str(out),
            "num_params": model.config.num_params()}
