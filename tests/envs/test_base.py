"""The environment contract (`jaxrl.envs.base`): what `observation_problem` says of each
answer that breaks it, and the one line of an `EnvFailure` naming the environment, the
dataset row, the sample and the turn. Where the rollout raises it: the rollout's own tests
(tests/step/test_multiturn_rollout.py); the run's exit status and message:
tests/run/test_env_failures.py."""

import numpy as np
import pytest

from jaxrl.envs.base import EnvFailure, Observation, observation_problem

VOCAB = 1000


@pytest.mark.parametrize("obs, problem", [
    ({"text": "hi"}, "env.step(turn) returned a dict; expected a jaxrl.envs.Observation"),
    (None, "env.step(turn) returned a NoneType; expected a jaxrl.envs.Observation"),
    (Observation(done=True, reward="high"),
     "Observation.reward must be a finite number or None, got 'high'"),
    (Observation(done=True, reward=float("nan")),
     "Observation.reward must be a finite number or None, got nan"),
    (Observation(done=True, reward=float("-inf")),
     "Observation.reward must be a finite number or None, got -inf"),
    (Observation(done=True, reward=True),
     "Observation.reward must be a finite number or None, got True"),
    (Observation(text=b"bytes"), "Observation.text must be a str or None, got a bytes"),
    (Observation(ids=[3, 1_000_000]),
     f"Observation.ids must be token ids in [0, {VOCAB}) (the model's vocabulary), "
     f"got [1000000]"),
    (Observation(ids=[-1, 5, VOCAB]),
     f"Observation.ids must be token ids in [0, {VOCAB}) (the model's vocabulary), "
     f"got [-1, {VOCAB}]"),
    (Observation(ids=[1.5, 2.0]), "Observation.ids must be a sequence of int token ids, got "
                                  "[1.5, 2.0]"),
])
def test_each_broken_contract_is_named(obs, problem):
    assert observation_problem(obs, VOCAB) == problem


@pytest.mark.parametrize("obs", [
    Observation(), Observation(done=True, reward=0), Observation(done=True, reward=-2.5),
    Observation(done=True, reward=np.float32(0.5)), Observation(text="4"),
    Observation(ids=[0, VOCAB - 1]), Observation(ids=np.array([3, 4])), Observation(ids=[]),
])
def test_answers_that_keep_the_contract_have_no_problem(obs):
    assert observation_problem(obs, VOCAB) is None


def test_without_a_vocabulary_ids_are_not_range_checked():
    assert observation_problem(Observation(ids=[1_000_000])) is None


def test_a_failure_names_the_environment_dataset_row_sample_and_turn():
    failure = EnvFailure("env.step(turn) raised ValueError: simulator crashed", row=3, turn=1)
    assert str(failure) == "sample 3, turn 1: env.step(turn) raised ValueError: simulator crashed"
    named = failure.at("pkg.envs:sim", 17)  # run_episodes: the batch row's dataset row
    assert str(named) == ("data.env='pkg.envs:sim', dataset row 17 (sample 3 of the batch), "
                          "turn 1: env.step(turn) raised ValueError: simulator crashed")
    assert (named.spec, named.dataset_row, named.row, named.turn) == ("pkg.envs:sim", 17, 3, 1)
    making = EnvFailure("the factory (row -> Environment) raised KeyError: 'question'", row=0,
                        spec="pkg.envs:sim", dataset_row=0)  # no turn: making the environment
    assert str(making) == ("data.env='pkg.envs:sim', dataset row 0 (sample 0 of the batch): "
                           "the factory (row -> Environment) raised KeyError: 'question'")
