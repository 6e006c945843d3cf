"""A multi-turn run's environments from its config (`jaxrl.run.episodes.make_episodes`): the
user's builder is called and its factory tried on the first dataset row before anything runs,
so a builder that raises, or a factory that raises or makes no environment, is a ConfigError
naming `data.env`, the row and the contract (`jaxrl train` exits 2 on it, leaving nothing:
tests/run/test_env_failures.py)."""

import pytest

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.config.load import load_config, shipped_config
from jaxrl.data.tasks.registry import make_task
from jaxrl.rollout.settings import PagedAttentionSettings
from jaxrl.run.episodes import make_episodes

ENVS = "tests.envs.hostile_envs"


@pytest.fixture(scope="module")
def addition():
    """(the quickstart's task, its tokenizer)."""
    cfg = load_config(ExperimentConfig, shipped_config("quickstart.yaml"),
                      ["data.num_prompts=16"])
    task = make_task(cfg.data, seed=0)
    return task, task.tokenizer()


def _episodes(addition, env, *overrides):
    task, tokenizer = addition
    spec = f"{ENVS}:{env}"
    cfg = load_config(ExperimentConfig, shipped_config("quickstart.yaml"),
                      ["data.num_prompts=16", f"data.env={spec}", "rollout.max_turns=2",
                       *overrides])
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


def test_turn_and_episode_end_ids_outside_the_vocabulary_are_refused_before_step_0(addition):
    """The ids that end a turn (rollout.stop_token_ids here) or an episode must be ids the
    policy can sample: one past its vocabulary is a ConfigError (exit 2) naming it."""
    task, tokenizer = addition
    spec = f"{ENVS}:factory_failing_after_its_first_row"
    cfg = load_config(ExperimentConfig, shipped_config("quickstart.yaml"),
                      ["data.num_prompts=16", f"data.env={spec}", "rollout.max_turns=2",
                       "rollout.stop_token_ids=[3,999]"])
    eos = (tokenizer.eos_token_id,)
    assert make_episodes(cfg, spec, task, tokenizer, eos, 1000).config.turn_end_token_ids
    with pytest.raises(ConfigError) as info:
        make_episodes(cfg, spec, task, tokenizer, eos, 999)
    assert str(info.value).startswith(
        f"data.env={spec!r}: the token ids that end a turn or an episode (the tool format's "
        f"end tags, rollout.stop_token_ids, EOS) include [999], outside the policy's "
        f"vocabulary [0, 999)")


def test_a_factory_that_works_on_the_first_row_gives_the_episodes(addition):
    """A factory failing only after its first row passes here; the rollout names the row it
    fails on (tests/step/test_multiturn_rollout.py)."""
    episodes = _episodes(addition, "factory_failing_after_its_first_row")
    assert episodes.spec == f"{ENVS}:factory_failing_after_its_first_row"
    assert len(episodes.rows) == 16 and episodes.config.max_turns == 2


def test_the_episodes_read_the_pool_as_rollout_engine_says(addition):
    """A multi-turn run's slots read their pages with `rollout.engine`'s kernel, pages per
    block and page size, as a single-turn run's do (not always XLA's)."""
    episodes = _episodes(addition, "factory_failing_after_its_first_row",
                         "rollout.engine.attention=pallas", "rollout.engine.pages_per_block=2",
                         "rollout.engine.page_size=8")
    assert episodes.config.attention == PagedAttentionSettings("pallas", 2)
    assert episodes.config.page_size == 8
