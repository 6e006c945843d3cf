"""Checkpoints: bit-exact round trip, another mesh layout, keep-last-K, corrupt fallback."""

import logging
import types

import jax
import numpy as np
import pytest
from rich.console import Console

from jaxrl.config import ExperimentConfig, load_config
from jaxrl.run.build import build_run
from jaxrl.run.checkpoint import Checkpoints, RestoreError, restore_key, restore_policy

TINY = ["rollout.num_generations=2", "data.num_prompts=64", "data.batch_size=8",
        "data.max_prompt_len=6", "data.chat_template=false", "perf.count_flops=false",
        "model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_heads=4",
        "model.init.num_kv_heads=2", "model.init.num_layers=1"]


def _run(tmp_path, name, layout):
    """The train state and mesh of a freshly built run."""
    cfg = load_config(ExperimentConfig, None, [*TINY, f"sharding.layout={layout}"])
    run, state = build_run(cfg, tmp_path / name, Console(quiet=True))
    return types.SimpleNamespace(state=state, mesh=run.mesh)


def _host(state):
    return jax.tree.map(np.asarray, state)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint")
    # (1, 8, 1) and (2, 2, 2) meshes: the same model, laid out differently.
    return tmp, _run(tmp, "a", "fsdp"), _run(tmp, "b", "dp_fsdp_tp")


def test_restores_bit_exact_onto_another_mesh_layout(runs):
    tmp, a, b = runs
    saved = _host(a.state)
    batches = {"epoch": np.array(2), "offset": np.array(16)}
    checkpoints = Checkpoints(tmp / "x", keep=3)
    checkpoints.save(7, a.state, batches, jax.random.key(5))
    checkpoints.wait()
    restored = checkpoints.restore(b.state)
    assert restored.step == 7
    _assert_same(saved, _host(restored.state))
    # Every array comes back in the target's (2, 2, 2) layout, not the (1, 8, 1) it was saved in.
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(b.state), strict=True):
        assert got.sharding == want.sharding
    assert dict(b.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert {k: int(v) for k, v in restored.data.items()} == {"epoch": 2, "offset": 16}
    assert np.array_equal(jax.random.key_data(restore_key(restored.meta)),
                          jax.random.key_data(jax.random.key(5)))


def test_save_returns_once_the_state_may_be_donated(runs):
    tmp, a, _ = runs
    state = jax.tree.map(lambda x: x.copy(), a.state)
    saved = _host(state)
    checkpoints = Checkpoints(tmp / "donated", keep=3)
    checkpoints.save(1, state, {"offset": np.array(0)}, jax.random.key(0))
    jax.tree.map(lambda x: x.delete(), state)  # what the next step's donation does
    checkpoints.wait()
    _assert_same(saved, _host(checkpoints.restore(a.state).state))


def test_keeps_the_newest_and_restores_a_policy_alone(runs):
    tmp, a, b = runs
    checkpoints = Checkpoints(tmp / "keep", keep=2)
    for step in (2, 4, 6):
        checkpoints.save(step, a.state, {"offset": np.array(step)}, jax.random.key(0))
    checkpoints.wait()
    assert checkpoints.steps() == [4, 6]
    step, state = restore_policy(tmp / "keep", b.state, step=4)
    assert step == 4
    _assert_same(_host(a.state["model"]), _host(state["model"]))
    assert restore_policy(tmp / "none", b.state) == (None, b.state)
    with pytest.raises(RestoreError, match=r"no checkpoint at step 2 .*\[4, 6\]"):
        checkpoints.restore(b.state, step=2)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(runs, caplog):
    tmp, a, b = runs
    checkpoints = Checkpoints(tmp / "corrupt", keep=3)
    first = _host(a.state)
    checkpoints.save(3, a.state, {"offset": np.array(1)}, jax.random.key(0))
    changed = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, a.state)
    checkpoints.save(6, changed, {"offset": np.array(2)}, jax.random.key(0))
    checkpoints.wait()
    # Truncate every data file of checkpoint 6's parameters to half its size.
    files = [f for f in (tmp / "corrupt" / "checkpoints" / "6" / "model").rglob("*")
             if f.is_file() and f.stat().st_size > 64]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        restored = Checkpoints(tmp / "corrupt").restore(b.state)
    assert restored.step == 3
    assert int(restored.data["offset"]) == 1
    _assert_same(first, _host(restored.state))
    assert "checkpoint 6" in caplog.text and "falling back" in caplog.text
    # When no checkpoint can be read, that is an error, not a fresh start.
    for f in (tmp / "corrupt" / "checkpoints" / "3" / "model").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(RestoreError, match="could be read"):
        Checkpoints(tmp / "corrupt").restore(b.state)


def test_an_unfinished_save_is_not_a_checkpoint(runs):
    tmp, a, _ = runs
    checkpoints = Checkpoints(tmp / "partial", keep=3)
    checkpoints.save(2, a.state, {"offset": np.array(0)}, jax.random.key(0))
    checkpoints.wait()
    # What a process killed mid-save leaves: orbax's temporary directory, never renamed.
    (tmp / "partial" / "checkpoints" / "4.orbax-checkpoint-tmp-123").mkdir()
    assert Checkpoints(tmp / "partial").steps() == [2]
