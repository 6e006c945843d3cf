"""`plan(cfg, ...)`: how a run's step is assembled, decided once from its config and printed
once (`RunPlan.describe`); the run keeps it (`Run.plan`), the step's one factory makes its
rollout source from it (`jaxrl.step.builder.build_step`), and whatever depends on the mode
asks it, never the config or the source again.

    algo.mode    fused   one program (rollout, rewards, updates); with Python rewards on
                         several processes: split (each process scores its own rows between
                         the two programs; the same results)
                 split   two programs, the host between them
                 async   rollout and updates on two sub-meshes (`sharding.rollout_devices`)
    multi-turn   (an environment answers the turns, `data.env` or the task's own): split,
                 the host runs the environments between turns; async, algo.advantage=gae and
                 several processes are refused
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.config.experiment import ExperimentConfig
from jaxrl.config_base import ConfigError

Mode = Literal["fused", "split", "async"]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """How the step is assembled: its `mode`, the environment of a multi-turn run (None:
    single-turn), whether an async rollout takes in-flight weight updates, how many batches
    it makes ahead (`max_staleness`, 0 unless async), and why the mode differs from
    `algo.mode` (None: it does not)."""

    mode: Mode
    env: str | None = None
    inflight: bool = False
    why: str | None = None
    max_staleness: int = 0

    @property
    def keeps_queue(self) -> bool:
        """Batches are made ahead on a rollout sub-mesh and saved with checkpoints."""
        return self.mode == "async"

    @property
    def multiturn(self) -> bool:
        """An environment answers the turns; the host drives the decode loop (no compiled
        rollout program to count FLOPs of)."""
        return self.env is not None

    def describe(self) -> str | None:
        """The line the run prints once when the mode is not the one asked for."""
        return None if self.why is None else f"[bold]algo.mode[/]: {self.mode} ({self.why})"


def splits_devices(cfg: ExperimentConfig) -> bool:
    """Whether the run generates and trains on two sub-meshes (algo.mode=async). The meshes
    are made before the rewards are known, so this part of the plan is read from the config
    alone; `plan` never turns a run into or out of async."""
    return cfg.algo.mode == "async"


def plan(cfg: ExperimentConfig, *, env: str | None, python_rewards: bool,
         processes: int) -> RunPlan:
    """The run's `RunPlan` (module docstring); a combination that cannot run is a
    ConfigError naming it and what to use instead."""
    mode, why = cfg.algo.mode, None
    if processes > 1 and python_rewards and mode == "fused":
        mode, why = "split", (f"Python rewards on {processes} processes: each scores its own "
                              f"rows; same results as fused")
    if env is not None:
        turns = f"multi-turn rollouts (environment {env!r})"
        if mode == "async":
            raise ConfigError(f"{turns} run in algo.mode=split (the host answers the turns "
                              f"between programs); got algo.mode=async: use algo.mode=split")
        if cfg.algo.advantage == "gae":
            raise ConfigError(f"{turns} are trained with group advantages (grpo, rloo, "
                              f"dr_grpo); algo.advantage=gae would need values on observation "
                              f"tokens: use algo.advantage=grpo, rloo or dr_grpo")
        if processes > 1:
            raise ConfigError(f"{turns} run in one process for now; this run has {processes}: "
                              f"use one process (its devices on one host)")
        if mode == "fused":
            mode, why = "split", (f"{turns}: the host runs the environments between turns, "
                                  f"which one compiled program cannot; same updates")
    is_async = splits_devices(cfg)
    return RunPlan(mode, env, cfg.rollout.inflight_updates and is_async, why,
                   cfg.algo.max_staleness if is_async else 0)
