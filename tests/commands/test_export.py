"""`jaxrl export`: a checkpoint becomes an HF directory that transformers loads with the same
logits as jaxrl's policy of that checkpoint; a damaged newest checkpoint is moved aside with a
warning and the one before exported; and the non-finite guard of the training loop."""

import json
import logging
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from rich.console import Console

from jaxrl.cli import EXIT_CONFIG_ERROR, main
from jaxrl.models import from_pretrained
from jaxrl.run.metrics_log import read_metrics
from jaxrl.saved.checkpoint import Checkpoints
from tests.run.test_loop import NO_FLOPS, _config

QUICK = [NO_FLOPS, "log.plot=false", "log.tensorboard=false", "eval.num_prompts=0",
         "train.save_final=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    from jaxrl.run import loop

    loop.train(_config(tmp, *QUICK, "train.max_steps=2", "train.checkpoint_every=1"),
               Console(quiet=True))
    return tmp / "run"


def _jax_logits(model, ids_BxT):
    return np.asarray(model(jax.numpy.asarray(ids_BxT)), np.float32)


def test_export_loads_in_transformers_with_the_checkpoint_logits(trained, tmp_path):
    assert main(["export", str(trained), "--out", str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    # jaxrl's policy of the newest checkpoint (step 2), restored independently of the export.
    policy = from_pretrained(trained / "init_model")
    step, params = Checkpoints(trained).restore_model(nnx.state(policy))
    assert step == 2
    nnx.update(policy, params)
    exported = from_pretrained(tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(nnx.state(policy)), jax.tree.leaves(nnx.state(exported)),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # the values, bit for bit
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           attn_implementation="eager")
    ids_BxT = np.random.default_rng(0).integers(0, policy.config.vocab_size, (2, 7))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids_BxT)).logits.numpy()
    np.testing.assert_allclose(_jax_logits(policy, ids_BxT), want, rtol=1e-5, atol=1e-5)
    # The initial policy differs: the export really carries the trained parameters.
    initial = from_pretrained(trained / "init_model")
    assert not np.allclose(_jax_logits(initial, ids_BxT), want, atol=1e-4)


def test_export_a_chosen_step_and_refuse_bad_input(trained, tmp_path, capsys):
    assert main(["export", str(trained), "--step", "1", "--out", str(tmp_path / "one")]) == 0
    one, two = from_pretrained(tmp_path / "one"), from_pretrained(trained / "init_model")
    step, params = Checkpoints(trained).restore_model(nnx.state(two), 1)
    nnx.update(two, params)
    for a, b in zip(jax.tree.leaves(nnx.state(one)), jax.tree.leaves(nnx.state(two)),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert main(["export", str(trained), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint at step 7" in capsys.readouterr().err
    assert main(["export", str(trained), "--out", str(tmp_path / "one")]) == EXIT_CONFIG_ERROR
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "y")]) == EXIT_CONFIG_ERROR
    assert "not a jaxrl run directory" in capsys.readouterr().err


def test_export_falls_back_from_a_damaged_newest_checkpoint(trained, tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (run_dir / "checkpoints" / "2" / "model" / "_METADATA").write_text('{"tree_metadata": {')
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
    moved = run_dir / "checkpoints_damaged" / "2"
    assert "checkpoint 2" in caplog.text and str(moved) in caplog.text
    assert "JSONDecodeError" in caplog.text
    assert (moved / "model" / "_METADATA").read_text() == '{"tree_metadata": {'
    assert Checkpoints(run_dir).steps() == [1]
    # The parameters of checkpoint 1, bit for bit.
    want = from_pretrained(trained / "init_model")
    nnx.update(want, Checkpoints(trained).restore_model(nnx.state(want), 1)[1])
    got = from_pretrained(tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(nnx.state(want)), jax.tree.leaves(nnx.state(got)),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path, monkeypatch, capsys):
    # A loss that is NaN (a NaN reward no longer gets this far: it is a reward error, 0).
    from jaxrl.step import updates

    policy_loss = updates.policy_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        return loss * jax.numpy.nan, metrics

    monkeypatch.setattr(updates, "policy_loss", nan_loss)
    cfg = _config(tmp_path, *QUICK, "train.max_steps=10", "train.max_skipped_in_a_row=3",
                  "train.checkpoint_every=1")
    from jaxrl.run import loop

    with pytest.raises(loop.NonFiniteError, match="3 steps in a row had a non-finite loss"):
        loop.train(cfg, Console(quiet=True))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/skipped_in_a_row"] for r in records[:3]] == [1, 2, 3]
    assert [r["train/skipped_updates"] for r in records[:3]] == [2, 2, 2]  # 2 minibatches
    # Parameters and optimizer state never moved: every checkpoint equals the first policy.
    policy = from_pretrained(tmp_path / "run" / "init_model")
    checkpoints = Checkpoints(tmp_path / "run")
    for step in checkpoints.steps():
        _, params = checkpoints.restore_model(nnx.state(policy), step)
        for a, b in zip(jax.tree.leaves(nnx.state(policy)), jax.tree.leaves(params),
                        strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    assert checkpoints.steps()
