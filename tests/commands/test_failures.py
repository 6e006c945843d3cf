"""`jaxrl train` on inputs a user gets wrong and on faults: each ends in one message naming
the thing and what was expected, exit status 2 (bad input, and no run directory left behind)
or 1 (a fault, and nothing recorded lost)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.cli import EXIT_CONFIG_ERROR, main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


@pytest.mark.process
def test_a_huge_max_new_tokens_is_refused_before_xla_sees_it(tmp_path):
    # XLA aborts the process on shapes this large ("overflow in static extent product").
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "jaxrl.cli", "train", QUICKSTART, f"train.run_dir={tmp_path / 'r'}",
         "rollout.max_new_tokens=1000000000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_CONFIG_ERROR, result.stderr[-3000:]
    assert "the rollout's KV cache alone needs" in result.stderr
    assert "rollout.max_new_tokens 1,000,000,000" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()


def test_a_missing_model_path_is_named_as_such(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["train", QUICKSTART, f"train.run_dir={tmp_path / 'r'}",
                 f"model.path={missing}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"model.path: model directory {str(missing)!r} does not exist" in err, err
    assert "tokenizer" not in err.split("model.path:")[1].split(";")[0]
    assert not (tmp_path / "r").exists()


def test_a_data_file_that_is_not_utf8_is_named_with_its_line(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "2+2="}\n{"prompt": "\xff\xfe"}\n')
    assert main(["train", QUICKSTART, f"train.run_dir={tmp_path / 'r'}", "data.task=custom",
                 f"data.source={data}", "data.reward_fn=os.path:join"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"prompt file {str(data)!r} is not UTF-8 text: line 3, byte 13" in err, err
    assert not (tmp_path / "r").exists()


def test_a_random_policy_too_big_for_the_devices_is_refused_before_it_is_made(tmp_path, capsys):
    # Made layer by layer it would take hours; as one array XLA aborts the process.
    assert main(["train", QUICKSTART, f"train.run_dir={tmp_path / 'r'}",
                 "model.init.num_layers=100000000"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "model.init makes a policy of 6,169,600,001,088 parameters" in err, err
    assert "choose a smaller model.init" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override, words", [
    ("model.lora.target_modules=[]", ["model.lora.target_modules must be a non-empty list",
                                      "got []"]),
    ("model.lora.target_modules=['(q']", ["model.lora.target_modules must be a list of valid "
                                          "regexes ('(q' is not one: missing ), unterminated "
                                          "subpattern"]),
])
def test_empty_or_malformed_lora_targets_are_config_errors(override, words, tmp_path, capsys):
    assert main(["train", QUICKSTART, f"train.run_dir={tmp_path / 'r'}",
                 override]) == EXIT_CONFIG_ERROR
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("config error: "), err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "r").exists()


def test_lora_adapters_too_big_for_the_devices_are_refused_before_they_are_drawn(
        tmp_path, capsys, monkeypatch):
    # Drawn, these 2.8 billion parameters took 7 GB and then the OOM killer: the policy (and
    # its adapters) must not be made at all.
    from jaxrl.run import build

    def refuse(*args, **kwargs):
        raise AssertionError("the policy and its adapters were made")

    monkeypatch.setattr(build, "load_policy", refuse)
    assert main(["train", QUICKSTART, f"train.run_dir={tmp_path / 'r'}",
                 "model.lora.rank=1000000", "perf.memory_limit_gib=1"]) == EXIT_CONFIG_ERROR
    err = " ".join(capsys.readouterr().err.split())
    assert ("model.lora.rank=1,000,000 gives 2,816,000,000 adapter parameters" in err
            and "perf.memory_limit_gib" in err and "choose a smaller model.lora.rank" in err), err
    fits = int(err.split("at most rank ")[1].split(" fits")[0].replace(",", ""))
    assert 8 <= fits < 1_000_000
    assert not (tmp_path / "r").exists()


def test_a_full_disk_stops_the_run_with_exit_1_and_the_rerun_resumes(tmp_path, capsys,
                                                                     monkeypatch):
    import errno

    from jaxrl.run.metrics_log import MetricsLog, read_metrics

    write = MetricsLog.write

    def full_at_step_3(self, record):
        if record["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        write(self, record)

    run = [f"train.run_dir={tmp_path}", "train.max_steps=5", "train.checkpoint_every=1",
           "data.batch_size=8", "rollout.num_generations=4", "algo.num_minibatches=1",
           "eval.num_prompts=0", "perf.count_flops=false", "log.plot=false",
           "log.tensorboard=false", "train.save_final=false"]
    monkeypatch.setattr(MetricsLog, "write", full_at_step_3)
    assert main(["train", QUICKSTART, *run]) == 1
    err = capsys.readouterr().err
    assert f"the disk is full: writing {tmp_path / 'metrics.jsonl'} failed" in err, err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    monkeypatch.setattr(MetricsLog, "write", write)  # space freed
    assert main(["train", QUICKSTART, *run]) == 0
    assert "resume: from the checkpoint at step" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
