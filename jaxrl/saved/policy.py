"""A run directory's policy at one checkpoint, as a model (what `jaxrl export` and
`jaxrl serve` read).

    config.yaml of the run     -> the policy's architecture and dtypes
    model.path (or init_model) -> the model skeleton and the tokenizer
    checkpoint N (newest)      -> the parameters, restored onto one device
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import nnx

from jaxrl.config import ConfigError, ExperimentConfig, load_config
from jaxrl.models import Transformer, load_policy
from jaxrl.saved.checkpoint import Checkpoints, RestoreError, base_reference
from jaxrl.saved.files import CONFIG_FILE, INIT_MODEL_DIR, MARKER_FILE, is_run_dir


def load_run_policy(run_dir: str | Path, step: int | None = None
                    ) -> tuple[int, Transformer, Path]:
    """(the checkpoint's step, the policy with its parameters, the model directory holding
    the run's tokenizer) of checkpoint `step` (default: the newest) of `run_dir`."""
    run_dir = Path(run_dir)
    if not (is_run_dir(run_dir) and (run_dir / CONFIG_FILE).is_file()):
        raise ConfigError(f"{str(run_dir)!r} is not a jaxrl run directory (no {MARKER_FILE} "
                          f"and {CONFIG_FILE}); give the train.run_dir of a training run")
    cfg = load_config(ExperimentConfig, run_dir / CONFIG_FILE, saved=True)
    model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / INIT_MODEL_DIR
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"the run's initial model {str(model_dir)!r} (its architecture and "
                          f"tokenizer) is missing")
    # The checkpoint's tree is the one training used: the same dtype and layer stacking. The
    # attention kernel is this host's (`auto`): a run trained with cudnn is read on CPU too.
    model = load_policy(model_dir, dataclasses.replace(cfg.model.load_settings(),
                                                       attention_impl="auto"))
    checkpoints = Checkpoints(run_dir, async_save=False, base=None if cfg.model.lora is None
                              else base_reference(model_dir))
    try:
        step, params = checkpoints.restore_model(nnx.state(model), step)
    except RestoreError as e:
        raise ConfigError(str(e)) from None
    finally:
        checkpoints.close()
    nnx.update(model, params)
    return step, model, model_dir
