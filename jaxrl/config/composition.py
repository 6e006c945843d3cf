"""The composition matrix: every combination of the features a run combines either runs or
is refused when its config is loaded and planned (`plan`), with a message naming it. The
refusals come from the config's own checks and `plan`, so the table here (`table`, in
docs/composition.md) is computed from the same code that refuses.

    mode        fused | split | async | async + in-flight weight updates
    turns       single | multi-turn (the calculator tool task)
    advantage   grpo (group advantages; rloo, dr_grpo alike) | gae (PPO's critic)
    params      full | lora
    arch        dense | moe
    processes   1 | 2

`overrides(cell)` is the tiny run of a cell (`jaxrl train CONFIG overrides`) the composition
tests run for 3 steps.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from jaxrl.config.experiment import ExperimentConfig
from jaxrl.config.load import load_config, shipped_config
from jaxrl.config.plan import RunPlan, plan
from jaxrl.config_base import ConfigError

AXES: dict[str, tuple] = {
    "mode": ("fused", "split", "async", "async+inflight"),
    "turns": ("single", "multi"),
    "advantage": ("grpo", "gae"),
    "params": ("full", "lora"),
    "arch": ("dense", "moe"),
    "processes": (1, 2),
}
_MODE = {"fused": ["algo.mode=fused"], "split": ["algo.mode=split"],
         "async": ["algo.mode=async", "sharding.rollout_devices=0.5", "algo.max_staleness=1",
                   "algo.loss.tis_cap=2.0"],
         "async+inflight": ["algo.mode=async", "sharding.rollout_devices=0.5",
                            "algo.max_staleness=2", "algo.loss.tis_cap=2.0",
                            "rollout.inflight_updates=true"]}
_FEATURE = {
    "gae": ["algo.advantage=gae", "algo.critic.kind=separate", "algo.critic.warmup_steps=1",
            "algo.mask_zero_std_groups=false"],
    "lora": ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[.*_proj]"],
    "moe": ["model.init.family=qwen3_moe", "model.init.num_experts=4",
            "model.init.num_experts_per_tok=2", "model.init.moe_intermediate_size=32",
            "algo.router_aux_coef=0.01"],
}
_TINY = {"single": ("quickstart.yaml", ["data.batch_size=8", "data.num_prompts=64",
                                        "rollout.num_generations=4", "algo.num_minibatches=2"]),
         "multi": ("tool_multiplication.yaml", ["data.batch_size=4", "rollout.num_generations=4",
                                                "algo.num_minibatches=2"])}


@dataclasses.dataclass(frozen=True)
class Cell:
    mode: str
    turns: str
    advantage: str
    params: str
    arch: str
    processes: int

    @property
    def name(self) -> str:
        return "-".join(str(getattr(self, axis)) for axis in AXES)


def cells() -> list[Cell]:
    """Every combination, in the order of AXES."""
    return [Cell(*values) for values in itertools.product(*AXES.values())]


def config_name(cell: Cell) -> str:
    """The shipped config a cell's run starts from."""
    return _TINY[cell.turns][0]


def overrides(cell: Cell) -> list[str]:
    """The dotted overrides of a cell's tiny run (module docstring). LoRA adapts every
    projection of a dense model, the attention's of an MoE (its MLPs are experts)."""
    lora = [] if cell.params == "full" else [*_FEATURE["lora"], *(
        ["model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"] if cell.arch == "moe"
        else [])]
    return [*_TINY[cell.turns][1], *_MODE[cell.mode], *_FEATURE.get(cell.advantage, ()),
            *lora, *_FEATURE.get(cell.arch, ())]


@functools.cache
def planned(cell: Cell) -> RunPlan | str:
    """A cell's config loaded and planned: its `RunPlan`, or the message it is refused with."""
    try:
        cfg = load_config(ExperimentConfig, shipped_config(config_name(cell)), overrides(cell))
        return plan(cfg, env="tools" if cell.turns == "multi" else None, python_rewards=False,
                    processes=cell.processes)
    except ConfigError as e:
        return str(e)


def refusal(cell: Cell) -> str | None:
    """The message a cell is refused with when its config is loaded and planned; None: it
    runs."""
    result = planned(cell)
    return result if isinstance(result, str) else None


def table() -> str:
    """The matrix as a Markdown table: one row per cell, `runs` or the refusal."""
    lines = ["| " + " | ".join(AXES) + " | |", "|" + "---|" * (len(AXES) + 1)]
    for cell in cells():
        why = refusal(cell)
        lines.append("| " + " | ".join(str(getattr(cell, a)) for a in AXES) + " | "
                     + ("runs" if why is None else "refused: " + why.replace("|", "/")) + " |")
    return "\n".join(lines) + "\n"
