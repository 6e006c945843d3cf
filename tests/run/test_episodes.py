"""A multi-turn run's environments from its config (`jaxrl.run.episodes.make_episodes`): the
user's builder is called and its factory tried on the first dataset row before anything runs,
so a builder that raises, or a factory that raises or makes no environment, is a ConfigError
naming `data.env`, the row and the contract (`jaxrl train` exits 2 on it, leaving nothing:
tests/run/test_env_failures.py)."""

import pytest

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.config.load import load_config, shipped_config
from jaxrl.data.tasks.registry import make_task
from jaxrl.run.episodes import make_episodes

ENVS = "tests.envs.hostile_envs"


@pytest.fixture(scope="module")
def addition():
    """(the quickstart's task, its tokenizer)."""
    cfg = load_config(ExperimentConfig, shipped_config("quickstart.yaml"),
                      ["data.num_prompts=16"])
    task = make_task(cfg.data, seed=0)
    return task, task.tokenizer()


def _episodes(addition, env):
    task, tokenizer = addition
    spec = f"{ENVS}:{env}"
    cfg = load_config(ExperimentConfig, shipped_config("quickstart.yaml"),
                      ["data.num_prompts=16", f"data.env={spec}", "rollout.max_turns=2"])
    return make_episodes(cfg, spec, task, tokenizer, (tokenizer.eos_token_id,))


@pytest.mark.parametrize("env, message", [
    ("raising_builder", "data.env='tests.envs.hostile_envs:raising_builder': the builder raised "
                        "RuntimeError: no simulator on this host; expected build(tools_config, "
                        "tokenizer) -> factory"),
    ("raising_factory", "data.env='tests.envs.hostile_envs:raising_factory', dataset row 0 "
                        "(sample 0 of the batch): the factory (row -> Environment) raised "
                        "KeyError: 'question'"),
    ("not_an_env_factory", "data.env='tests.envs.hostile_envs:not_an_env_factory', dataset row 0 "
                           "(sample 0 of the batch): the factory returned a int, which has no "
                           "step(turn) -> Observation method"),
])
def test_a_broken_builder_or_factory_is_a_config_error_naming_spec_row_and_contract(
        addition, env, message):
    with pytest.raises(ConfigError) as info:
        _episodes(addition, env)
    assert str(info.value) == message


def test_a_factory_that_works_on_the_first_row_gives_the_episodes(addition):
    """A factory failing only after its first row passes here; the rollout names the row it
    fails on (tests/step/test_multiturn_rollout.py)."""
    episodes = _episodes(addition, "factory_failing_after_its_first_row")
    assert episodes.spec == f"{ENVS}:factory_failing_after_its_first_row"
    assert len(episodes.rows) == 16 and episodes.config.max_turns == 2
