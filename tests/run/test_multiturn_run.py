"""A multi-turn run through the CLI (`configs/tool_multiplication.yaml`, shrunk): episodes with
the calculator, their metrics, evaluation through the same episodes; and the configs a
multi-turn run refuses, each exiting with status 2 and naming the problem."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.cli import EXIT_CONFIG_ERROR, main
from jaxrl.data.tasks.tool_multiplication import answer_reward, tool_call_reward
from jaxrl.envs.base import Observation
from jaxrl.run.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "configs" / "tool_multiplication.yaml")
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
SMALL = ["data.batch_size=4", "rollout.num_generations=4", "algo.num_minibatches=2",
         "log.tensorboard=false", "log.plot=false", "perf.count_flops=false"]
TURN_METRICS = ("turns/mean", "tool/calls_per_sample", "tool/errors", "tool/timeouts",
                "tool/latency_s", "env/time_s", "env/wait_s", "rollout/truncated_frac",
                "time/rollout_s")


def test_tool_task_runs_episodes_and_evaluates_them(tmp_path, capsys):
    """On the (2, 2, 2) mesh (data x fsdp x tensor): the episodes' 16 slots split over
    data x fsdp, 4 per device (that they are one device's episodes:
    tests/step/test_multiturn_step.py)."""
    code = main(["train", TOOL, f"train.run_dir={tmp_path}", "train.max_steps=2",
                 "eval.num_prompts=6", "eval.batch_size=4", "sharding.layout=dp_fsdp_tp",
                 *SMALL])
    assert code == 0
    out = capsys.readouterr()
    assert "algo.mode" not in out.out + out.err  # the config is split already: no switch note
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        for name in TURN_METRICS:
            assert name in record, name
        assert 1 <= record["turns/mean"] <= 3
        assert record["tool/errors"] <= record["tool/calls_per_sample"]
        assert 0 <= record["reward/answer"] <= 1 and 0 <= record["reward/tool_call"] <= 1
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["step_compilations"] == 1 and summary["eval/num_prompts"] == 6
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 2 and 0 <= evals[-1]["eval/reward_mean"] <= 1


def test_a_fused_multiturn_config_is_switched_to_split(tmp_path, capsys):
    code = main(["train", TOOL, f"train.run_dir={tmp_path}", "train.max_steps=1",
                 "eval.num_prompts=0", "algo.mode=fused", "train.save_final=false", *SMALL])
    assert code == 0
    assert "algo.mode: split (multi-turn rollouts" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("config, overrides, words", [
    (QUICKSTART, ["rollout.max_turns=2"], ["rollout.max_turns=2", "data.env", "addition"]),
    (QUICKSTART, ["data.env=nope"], ["data.env='nope'", "unknown environment", "tools"]),
    (QUICKSTART, ["data.env=no_such_module:build"], ["no_such_module", "does not import"]),
    (TOOL, ["algo.advantage=gae"], ["algo.advantage=gae", "observation"]),
    (TOOL, ["data.tools.format=hermes"], ["'</tool_call>'", "tokens of this tokenizer"]),
    (TOOL, ["rollout.max_total_tokens=4"], ["rollout.max_total_tokens", "12"]),
    (TOOL, ["data.tools.names=[calculator,perl]"], ["data.tools.names", "perl"]),
])
def test_bad_multiturn_configs_exit_2_naming_the_problem(config, overrides, words, tmp_path,
                                                         capsys):
    code = main(["train", config, f"train.run_dir={tmp_path}", "train.max_steps=1", *SMALL,
                 *overrides])
    assert code == EXIT_CONFIG_ERROR
    text = " ".join(capsys.readouterr().err.split())
    for word in words:
        assert word in text, (word, text)


def test_the_python_tool_without_its_sandbox_program_exits_2_saying_how_to_install_it(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no bwrap on it
    code = main(["train", TOOL, f"train.run_dir={tmp_path / 'r'}", "train.max_steps=1", *SMALL,
                 "data.tools.names=[python]"])
    assert code == EXIT_CONFIG_ERROR
    text = " ".join(capsys.readouterr().err.split())
    for words in ("data.tools.names=['python'] includes python", "`bwrap` is not on PATH",
                  "apt-get install bubblewrap", "data.tools.python_sandbox=guard"):
        assert words in text, (words, text)
    assert not (tmp_path / "r").exists()


def test_tool_task_rewards_by_hand():
    fields = {"expression": "4821*7306", "answer": "35222226"}
    right = "<call>4821*7306</call><result>35222226</result>35222226"
    assert answer_reward("", right, fields) == 1 and tool_call_reward("", right, fields) == 1
    # One wrong digit of the call (10 of 11 positions), and an answer one digit short
    # (7 of 8 digits right, the length wrong: 7 of 9).
    partial = "<call>4821*7307</call><result>35222226</result>3522222"
    assert tool_call_reward("", partial, fields) == pytest.approx(10 / 11)
    assert answer_reward("", partial, fields) == pytest.approx(7 / 9)
    # The right product without the calculator's result earns nothing (a tool-use task); a
    # call never closed earns its prefix only.
    assert tool_call_reward("", "35222226", fields) == 0
    assert answer_reward("", "35222226", fields) == 0
    assert answer_reward("", "<call>1*1</call><result>1</result>35222226", fields) == 0
    assert tool_call_reward("", "<call>4821*73", fields) == pytest.approx(8 / 11)


@pytest.mark.learning
def test_tool_task_learns_to_call_the_calculator(tmp_path):
    """The shipped config, shortened (the full curve is in benchmarks/README.md): in 60 steps
    the random policy goes from calling the calculator in a third of its samples, with
    garbage, to calling it in nearly every sample, with the call's first characters right."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as README
    result = subprocess.run(
        [sys.executable, "-m", "jaxrl.cli", "train", TOOL, f"train.run_dir={tmp_path}",
         "train.max_steps=60", "eval.num_prompts=0", "log.plot=false", "log.tensorboard=false",
         "train.save_final=false"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    first, last = records[0], records[-10:]

    def mean(name):
        return sum(r[name] for r in last) / len(last)

    # Measured (seed 0): calls 0.35 -> ~1.0 per sample, call reward 0.006 -> ~0.15.
    assert first["tool/calls_per_sample"] < 0.5 and mean("tool/calls_per_sample") > 0.9
    assert first["reward/tool_call"] < 0.02 and mean("reward/tool_call") > 0.1
    assert mean("turns/mean") > 1.8


class _QuarterEnv:
    """Ends every episode after its first turn with the reward 0.25."""

    def step(self, turn):
        return Observation(done=True, reward=0.25)


def quarter_env(tools_config, tokenizer):
    """A user's environment builder, as data.env names it ("module:attribute")."""
    return lambda row: _QuarterEnv()


def test_a_user_environment_reward_joins_the_task_rewards(tmp_path):
    code = main(["train", QUICKSTART, f"train.run_dir={tmp_path}", "train.max_steps=1",
                 "eval.num_prompts=0", "train.save_final=false",
                 "data.env=tests.run.test_multiturn_run:quarter_env", "rollout.max_turns=2",
                 *SMALL])
    assert code == 0
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["reward/env"] == 0.25 and record["turns/mean"] == 1
    assert record["reward/mean"] == pytest.approx(record["reward/addition"] + 0.25, abs=1e-6)
