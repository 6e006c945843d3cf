"""The reward guard (`jaxrl.run.hooks.guards.RewardGuard`) on a run's step records: a reward
failing on more than `train.reward_error_frac` of a step's samples for
`train.reward_error_steps` steps in a row stops the run with its first error (a
TrainingStopped: `jaxrl train` exits 1, the steps before it on disk:
tests/commands/test_train.py); a step at or under the fraction restarts the count, and
`reward_error_frac=1` never stops. (The non-finite guard: tests/commands/test_export.py.)"""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config.run import TrainSection
from jaxrl.rl import JaxReward, PythonReward, RewardInputs, RewardSet
from jaxrl.run.hooks.guards import RewardFailureError, RewardGuard, TrainingStopped

ROWS = 16  # data.batch_size x rollout.num_generations


def raises(prompt, completion, fields):
    raise RuntimeError(f"reward exploded on {prompt!r}")


def _rewards(*rewards) -> RewardSet:
    """A reward set whose Python rewards have scored one batch of ROWS samples "3+1=" -> "4"."""
    reward_set = RewardSet(list(rewards), decode=lambda ids, mask: [
        "3+1=" if ids.shape[1] == 3 else "4"] * len(ids))
    if any(isinstance(r, PythonReward) for r in rewards):
        ids = np.zeros((ROWS, 3), np.int32)
        reward_set.score_host(RewardInputs(ids, ids, ids[:, :1], ids[:, :1], {},
                                           np.arange(ROWS)))
    return reward_set


def _run(guard, reward_set, failed_per_step, name):
    """The guard on steps 0, 1, ... whose records count `failed_per_step` samples failed by
    the reward `name`; the steps it let pass."""
    trainer = SimpleNamespace(run=SimpleNamespace(step=SimpleNamespace(rewards=reward_set)))
    passed = []
    for step, failed in enumerate(failed_per_step):
        record = {"reward/errors": float(failed), f"reward/errors/{name}": float(failed)}
        guard.on_record(trainer, step, record, None)
        passed.append(step)
    return passed


def test_a_reward_failing_on_most_samples_steps_in_a_row_stops_the_run_with_its_first_error():
    reward_set = _rewards(PythonReward("raises", raises))
    guard = RewardGuard(TrainSection(reward_error_frac=0.5, reward_error_steps=2), ROWS)
    with pytest.raises(RewardFailureError) as info:
        _run(guard, reward_set, [ROWS, ROWS, ROWS], "raises")
    assert isinstance(info.value, TrainingStopped)  # the command's exit 1
    assert str(info.value) == (
        "step 1: reward 'raises' failed on 100% of the step's samples, more than "
        "train.reward_error_frac=0.5, 2 steps in a row (train.reward_error_steps=2); its first "
        "error: PythonReward 'raises' on prompt '3+1=' and completion '4': RuntimeError: "
        "reward exploded on '3+1='")


def test_a_step_at_or_under_the_fraction_restarts_the_count():
    reward_set = _rewards(PythonReward("raises", raises))
    guard = RewardGuard(TrainSection(reward_error_frac=0.5, reward_error_steps=2), ROWS)
    with pytest.raises(RewardFailureError, match=r"^step 5: reward 'raises' failed on 75% of"):
        # 9 of 16 is more than 0.5; 8 of 16 is not, and restarts the count.
        _run(guard, reward_set, [9, ROWS // 2, ROWS, 0, 12, 12], "raises")


def test_a_run_allowed_to_fail_its_rewards_goes_on():
    """reward_error_frac=1: a fraction of failed samples is never more than that (every
    failure still counts: reward/errors, summed by the summary: tests/run/test_summary.py)."""
    reward_set = _rewards(PythonReward("raises", raises))
    guard = RewardGuard(TrainSection(reward_error_frac=1.0, reward_error_steps=1), ROWS)
    assert _run(guard, reward_set, [ROWS] * 5, "raises") == [0, 1, 2, 3, 4]


def test_a_jax_reward_is_named_by_its_count_and_another_process_by_its_log():
    """A JAX reward's first error is noted from the record itself; a Python reward that
    failed only on another process's rows has no error here: its log has it."""
    wild = JaxReward("wild", lambda inputs: jnp.full((ROWS,), 2.0))
    guard = RewardGuard(TrainSection(reward_error_steps=1), ROWS)
    with pytest.raises(RewardFailureError) as info:
        _run(guard, _rewards(wild), [ROWS], "wild")
    assert str(info.value).endswith("its first error: JaxReward 'wild' returned values outside "
                                    "[0, 1] or non-finite on 16 samples of step 0")
    python = RewardSet([PythonReward("elsewhere", raises)], decode=lambda ids, mask: [])
    with pytest.raises(RewardFailureError) as info:
        _run(RewardGuard(TrainSection(reward_error_steps=1), ROWS), python, [ROWS], "elsewhere")
    assert str(info.value).endswith("its first error: reward 'elsewhere' failed on the rows of "
                                    "another process: see its log")
