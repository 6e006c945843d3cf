"""Environment builders that break the contract, for `data.env=tests.envs.hostile_envs:NAME`
(`build(tools_config, tokenizer) -> factory(row) -> env`). Each breaks one thing. (Answers
that break the contract: tests/envs/test_base.py and tests/step/test_multiturn_rollout.py.)"""

import os
import time
from pathlib import Path

from jaxrl.envs.base import Observation


class _Env:
    """An environment whose step is `answer(turn)`; touches $JAXRL_TEST_ENV_STARTED (a file
    path, when set) as a step starts, so a test knows an environment is running."""

    def __init__(self, answer):
        self.answer = answer

    def step(self, turn):
        started = os.environ.get("JAXRL_TEST_ENV_STARTED")
        if started:
            Path(started).touch()
        return self.answer(turn)


def _builder(answer):
    def build(tools_config, tokenizer):
        return lambda row: _Env(answer)
    return build


def raising_builder(tools_config, tokenizer):
    raise RuntimeError("no simulator on this host")


def raising_factory(tools_config, tokenizer):
    def factory(row):
        raise KeyError("question")
    return factory


def not_an_env_factory(tools_config, tokenizer):
    return lambda row: 42


def factory_failing_after_its_first_row(tools_config, tokenizer):
    made = []

    def factory(row):
        made.append(row)
        if len(made) > 1:
            raise OSError("the simulator pool is exhausted")
        return _Env(lambda turn: Observation(done=True))
    return factory


def _raise(turn):
    raise ValueError("simulator crashed")


def _hang(turn):
    time.sleep(3600)


def _slow(turn):
    time.sleep(2.0)
    return Observation(done=True, reward=0.0)


raising_step = _builder(_raise)
hanging = _builder(_hang)
slow = _builder(_slow)
