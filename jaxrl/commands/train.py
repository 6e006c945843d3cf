"""`jaxrl train CONFIG.yaml [dotted.key=value ...]`: run an RL experiment (see jaxrl.run.loop).

Prints the summary as a table and returns it; the run directory holds config.yaml,
metrics.jsonl, tensorboard/, eval.jsonl and reward.png.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from jaxrl.config import ExperimentConfig
from jaxrl.run.loop import train


def run_train(cfg: ExperimentConfig, console: Console, config_path: str | None) -> dict[str, Any]:
    """Trains; the default run directory is named after the config file."""
    name = Path(config_path).stem if config_path else "run"
    return train(cfg, console, name=name)
