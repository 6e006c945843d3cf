"""`plan(cfg, ...)`: the run's mode is decided once, with the reason printed, and the
combinations that cannot run are refused with a message naming them."""

import pytest

from jaxrl.config import ConfigError, ExperimentConfig, load_config, shipped_config
from jaxrl.config.plan import RunPlan, plan


def _cfg(*overrides: str) -> ExperimentConfig:
    return load_config(ExperimentConfig, shipped_config("quickstart.yaml"), list(overrides))


def test_the_mode_asked_for_is_kept_when_it_can_run():
    for mode in ("fused", "split"):
        got = plan(_cfg(f"algo.mode={mode}"), env=None, python_rewards=True, processes=1)
        assert got == RunPlan(mode) and got.describe() is None
    got = plan(_cfg("algo.mode=async", "algo.max_staleness=2", "rollout.inflight_updates=true"),
               env=None, python_rewards=False, processes=2)
    assert got == RunPlan("async", inflight=True, max_staleness=2)
    assert got.keeps_queue and not got.multiturn


def test_python_rewards_on_several_processes_run_split_and_say_why():
    got = plan(_cfg("algo.mode=fused"), env=None, python_rewards=True, processes=2)
    assert got.mode == "split"
    assert got.describe() == ("[bold]algo.mode[/]: split (Python rewards on 2 processes: each "
                              "scores its own rows; same results as fused)")
    # JAX rewards score in the program on every process: fused stays fused.
    assert plan(_cfg(), env=None, python_rewards=False, processes=2).mode == "fused"


def test_multi_turn_runs_split():
    got = plan(_cfg("algo.mode=fused"), env="tools", python_rewards=False, processes=1)
    assert (got.mode, got.env) == ("split", "tools")
    assert "the host runs the environments between turns" in got.describe()
    assert plan(_cfg("algo.mode=split"), env="tools", python_rewards=False,
                processes=1).describe() is None


@pytest.mark.parametrize("overrides, processes, message", [
    (["algo.mode=async", "algo.max_staleness=1"], 1,
     r"multi-turn rollouts \(environment 'tools'\) run in algo.mode=split .* got algo.mode=async"),
    (["algo.advantage=gae"], 1, r"group advantages .* algo.advantage=gae"),
    ([], 2, r"run in one process for now; this run has 2"),
])
def test_multi_turn_refuses_what_it_cannot_run(overrides, processes, message):
    with pytest.raises(ConfigError, match=message):
        plan(_cfg(*overrides), env="tools", python_rewards=False, processes=processes)
