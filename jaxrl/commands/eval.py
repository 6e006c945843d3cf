"""`jaxrl eval CONFIG [overrides] [--step N]`: evaluate a run's policy on held-out prompts.

    run     = build_run(cfg, train.run_dir)   the run `jaxrl train` builds; train.run_dir is
                                              required and may hold a training run, which is
                                              read, never refused or replaced; a new or empty
                                              folder is claimed as for training, any other
                                              folder refused
    policy  = the run directory's latest checkpoint (--step N: that one) when it has
              checkpoints; else its final_model/; else model.path; else its init_model/;
              else a random `model.init` policy (saved to init_model/, as training does)
    metrics = Evaluator(run, cfg.eval)(the policy's parameters)
              eval/reward_mean, eval/exact_match, eval/pass@k, eval/num_prompts, num_samples
    prints a table and returns the JSON object the CLI prints as its last stdout line;
    appends {"step": s, **metrics} to <run_dir>/eval.jsonl (s: the checkpoint's step, null
    for a model directory), where training appends its own evaluations.

A task without held-out prompts (`task.eval_rows` is None) is skipped with a message.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.run.build import build_run, policy
from jaxrl.run.evaluate import Evaluator, append_eval
from jaxrl.run.run_dir import claim_to_add
from jaxrl.saved.checkpoint import RestoreError, restore_policy
from jaxrl.saved.files import FINAL_MODEL_DIR, INIT_MODEL_DIR


def run_eval(cfg: ExperimentConfig, console: Console, *,
             step: int | None = None) -> dict[str, Any]:
    """Evaluates the run's policy (module docstring); returns the JSON object."""
    if not cfg.train.run_dir:
        raise ConfigError("jaxrl eval needs train.run_dir: the run directory whose policy to "
                          "evaluate (its checkpoints/ or final_model/), got null")
    if cfg.eval.num_prompts < 1:
        raise ConfigError(f"eval.num_prompts must be >= 1 for jaxrl eval, got "
                          f"{cfg.eval.num_prompts}")
    run_dir = Path(cfg.train.run_dir)
    claim_to_add(run_dir)
    cfg, source = _model_source(cfg, run_dir)
    console.print(f"[bold]run dir[/]: {run_dir}")
    run, state = build_run(cfg, run_dir, console)
    if run.task.eval_rows is None:
        reason = (f"data.task={run.task.name} has no held-out prompts (task.eval_rows); "
                  f"nothing evaluated")
        console.print(f"[bold yellow]eval skipped[/]: {reason}")
        return {"run_dir": str(run_dir), "step": None, "skipped": reason}

    try:
        restored, state = restore_policy(run_dir, state, step)
    except RestoreError as e:
        raise ConfigError(f"--step {step}: {e}" if step is not None else str(e)) from None
    if restored is None and step is not None:
        raise ConfigError(f"--step {step}: {str(run_dir)!r} holds no checkpoints")
    if restored is not None:
        source = f"checkpoint of step {restored}"
    console.print(f"[bold]eval[/]: {source}, {cfg.eval.num_prompts} held-out prompts x "
                  f"{cfg.eval.num_samples} sample(s), temperature {cfg.eval.sampling.temperature}")
    metrics = Evaluator(run, cfg.eval)(policy(run.step, state)[1])
    path = append_eval(run_dir, restored, metrics)
    console.print(_table(metrics, f"jaxrl eval: {source}"))
    console.print(f"[bold]appended to[/] {path}")
    return {"run_dir": str(run_dir), "step": restored, "policy": source, **metrics}


def _model_source(cfg: ExperimentConfig, run_dir: Path) -> tuple[ExperimentConfig, str]:
    """`cfg` with model.path the policy to build before any checkpoint is restored (module
    docstring's order), and that policy's description."""
    final = run_dir / FINAL_MODEL_DIR
    init = run_dir / INIT_MODEL_DIR
    if (final / "config.json").is_file():
        path = final
    elif cfg.model.path:
        return cfg, str(cfg.model.path)
    elif (init / "config.json").is_file():
        # The run's own random policy: reloaded, never made again over it.
        path = init
    else:
        return cfg, f"random {cfg.model.init.family} policy (model.path null)"
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path))), str(path)


def _table(metrics: dict[str, float], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in metrics.items():
        table.add_row(name, f"{value:.4g}")
    return table
