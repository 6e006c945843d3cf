"""A PPO run resumed from its checkpoint restores the critic and its optimizer: the resumed
steps give the metrics (value loss included) of an uninterrupted run, bitwise."""

import pytest

from jaxrl.run.metrics_log import read_metrics
from tests.run.test_resume import _finish, _start, _without_timing

PPO = ["algo.advantage=gae", "algo.critic.kind=separate", "algo.mask_zero_std_groups=false",
       "train.checkpoint_every=3"]


@pytest.mark.process  # starts `jaxrl train` three times
def test_resume_restores_the_critic(tmp_path):
    reference = _start(tmp_path / "reference", *PPO, "train.max_steps=6")
    first = _start(tmp_path / "resumed", *PPO, "train.max_steps=3")
    _finish(first)
    _, err = _finish(_start(tmp_path / "resumed", *PPO, "train.max_steps=6"))
    _finish(reference)
    assert "from the checkpoint at step 3" in err
    want = read_metrics(tmp_path / "reference" / "metrics.jsonl")
    got = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(6))
    # A critic started afresh (zero head) would give value/mean 0 at step 3.
    assert got[3]["value/mean"] != 0
    assert _without_timing(got) == _without_timing(want)
