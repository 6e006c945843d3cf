"""`jaxrl eval`: a run directory's policy evaluated through the CLI on 8 devices: a fresh
directory (a random policy), again (the same policy, reloaded), a directory holding a training
run and a checkpoint (read, never refused or replaced), a damaged newer checkpoint (moved
aside with a warning, the one before evaluated); bad invocations exit 2."""

import json
import logging
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from jaxrl.cli import EXIT_CONFIG_ERROR, main
from jaxrl.commands import eval as eval_command
from jaxrl.saved.checkpoint import Checkpoints
from jaxrl.saved.files import EVAL_FILE, FINAL_MODEL_DIR, INIT_MODEL_DIR
from tests.test_shipped_configs import ROOT

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
TINY = ["sharding.layout=fsdp", "data.batch_size=8", "data.num_prompts=64",
        "rollout.num_generations=4", "algo.num_minibatches=2", "perf.count_flops=false",
        "log.plot=false", "log.tensorboard=false", "eval.num_prompts=16", "eval.batch_size=8"]
SAMPLED = ["eval.num_samples=2", "eval.sampling.temperature=1.0", "eval.k=[1,2]"]


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def eval_lines(run_dir):
    return [json.loads(line) for line in (run_dir / EVAL_FILE).read_text().splitlines()]


def test_eval_a_fresh_run_dir_then_the_same_policy_then_a_checkpoint(tmp_path, capsys,
                                                                      monkeypatch, caplog):
    run_dir = tmp_path / "run"
    built = []
    build_run = eval_command.build_run

    def spying_build_run(*args, **kwargs):
        built.append(build_run(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(eval_command, "build_run", spying_build_run)
    argv = ["eval", QUICKSTART, f"train.run_dir={run_dir}", *TINY, *SAMPLED]

    # A fresh directory: the config's random policy, saved to init_model/ as training does.
    assert main(argv) == 0
    first = last_json(capsys)
    assert first["step"] is None and first["policy"].startswith("random qwen2")
    assert first["eval/num_prompts"] == 16 and first["eval/num_samples"] == 2
    assert 0 <= first["eval/pass@1"] <= first["eval/pass@2"] <= 1
    assert eval_lines(run_dir) == [{"step": None, **{k: v for k, v in first.items()
                                                     if k.startswith("eval/")}}]
    assert (run_dir / INIT_MODEL_DIR / "config.json").is_file()
    assert not (run_dir / "config.yaml").exists()  # eval leaves a run's files alone

    # Again: init_model/ is reloaded (not made anew), the same prompts and keys: same numbers.
    init_files = {p.name: p.stat().st_mtime_ns for p in (run_dir / INIT_MODEL_DIR).iterdir()}
    assert main(argv) == 0
    second = last_json(capsys)
    assert second["policy"] == str(run_dir / INIT_MODEL_DIR)
    assert {k: v for k, v in second.items() if k != "policy"} == \
           {k: v for k, v in first.items() if k != "policy"}
    assert init_files == {p.name: p.stat().st_mtime_ns
                          for p in (run_dir / INIT_MODEL_DIR).iterdir()}
    assert len(eval_lines(run_dir)) == 2

    # A run's final_model/ comes before model.path and init_model/ (here: the same weights).
    shutil.copytree(run_dir / INIT_MODEL_DIR, run_dir / FINAL_MODEL_DIR)
    assert main(argv) == 0
    final = last_json(capsys)
    assert final["policy"] == str(run_dir / FINAL_MODEL_DIR)
    assert final["eval/pass@2"] == first["eval/pass@2"]

    # A training run with a checkpoint after 3 steps (all-zero weights: greedy decoding then
    # emits token 0, <pad>, and never a digit): eval restores it and does not refuse the run.
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    run, state = built[-1]
    zeroed = jax.tree.map(lambda x: x * 0 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          state)
    checkpoints = Checkpoints(run_dir, async_save=False)
    checkpoints.save(3, zeroed, run.batches.state(), jax.random.key(0))
    checkpoints.close()
    assert main(["eval", QUICKSTART, f"train.run_dir={run_dir}", *TINY]) == 0
    restored = last_json(capsys)
    assert restored["step"] == 3 and restored["policy"] == "checkpoint of step 3"
    assert restored["eval/reward_mean"] == 0.0 and restored["eval/pass@1"] == 0.0
    assert eval_lines(run_dir)[-1]["step"] == 3 and len(eval_lines(run_dir)) == 4
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'

    # A step without a checkpoint names it and what there is.
    assert main(["eval", QUICKSTART, f"train.run_dir={run_dir}", *TINY, "--step", "5"]) == \
        EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "--step 5" in err and "[3]" in err
    assert len(eval_lines(run_dir)) == 4

    # A newer checkpoint (the random weights) whose parameter files were cut short: asked for,
    # it is an error naming it; else eval falls back to step 3 and moves it aside, with a warning.
    checkpoints = Checkpoints(run_dir, async_save=False)
    checkpoints.save(5, state, run.batches.state(), jax.random.key(0))
    checkpoints.close()
    for f in (run_dir / "checkpoints" / "5" / "model").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert main(["eval", QUICKSTART, f"train.run_dir={run_dir}", *TINY, "--step", "5"]) == \
        EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "--step 5" in err and "checkpoint 5" in err and "cannot be read" in err
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        assert main(["eval", QUICKSTART, f"train.run_dir={run_dir}", *TINY]) == 0
    fell_back = last_json(capsys)
    assert fell_back["step"] == 3 and fell_back["policy"] == "checkpoint of step 3"
    assert fell_back["eval/reward_mean"] == 0.0  # step 3's all-zero weights
    assert "checkpoint 5" in caplog.text
    assert str(run_dir / "checkpoints_damaged" / "5") in caplog.text
    assert (run_dir / "checkpoints_damaged" / "5" / "model").is_dir()
    assert Checkpoints(run_dir).steps() == [3]
    assert [line["step"] for line in eval_lines(run_dir)[4:]] == [3]

    # A task without held-out prompts is skipped with a message; nothing is appended.
    no_rows = SimpleNamespace(task=SimpleNamespace(name="gsm8k", eval_rows=None))
    monkeypatch.setattr(eval_command, "build_run", lambda *args: (no_rows, None))
    assert main(argv) == 0
    skipped = last_json(capsys)
    assert "data.task=gsm8k has no held-out prompts" in skipped["skipped"]
    assert len(eval_lines(run_dir)) == 5


@pytest.mark.parametrize("overrides, words", [
    ([], ["train.run_dir", "null"]),
    (["train.run_dir=somewhere", "eval.num_prompts=0"], ["eval.num_prompts", ">= 1", "0"]),
    (["train.run_dir=somewhere", "eval.num_samples=4"], ["eval.num_samples=4",
                                                         "eval.sampling.temperature > 0"]),
])
def test_bad_eval_invocations_exit_2_naming_the_key(overrides, words, tmp_path, capsys,
                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", QUICKSTART, *overrides]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "somewhere").exists()
