"""Checkpoints: bit-exact round trip, another mesh layout, keep-last-K, and the fallback from a
damaged checkpoint (moved aside whole, so its step can be saved again)."""

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from jaxrl.config import ExperimentConfig, load_config
from jaxrl.run.build import build_run
from jaxrl.saved.checkpoint import Checkpoints, RestoreError, restore_key, restore_policy

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


def _arrays(step_dir):
    """The array data files of a checkpoint's parameters (orbax's OCDBT `d/` folders)."""
    files = [f for f in (step_dir / "model").rglob("*")
             if f.is_file() and f.parent.name == "d" and f.stat().st_size > 64]
    assert files
    return files


def _damage(step_dir, kind):
    """What a crash, a full disk or a bad copy leaves in a checkpoint's files."""
    if kind == "truncated arrays":
        for f in _arrays(step_dir):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "garbled meta JSON":
        (step_dir / "meta" / "metadata").write_text('{"step": 6, "key": [0, 1')
    elif kind == "garbled model metadata JSON":
        path = step_dir / "model" / "_METADATA"
        path.write_text(path.read_text()[:100])
    elif kind == "deleted array files":
        for f in _arrays(step_dir):
            f.unlink()


def _files(folder):
    return {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def _save_3_and_6(directory, state):
    """Checkpoints 3 (`state`) and 6 (`state` + 1), with iterator offsets 1 and 2."""
    checkpoints = Checkpoints(directory, keep=3)
    changed = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, state)
    checkpoints.save(3, state, {"offset": np.array(1)}, jax.random.key(0))
    checkpoints.save(6, changed, {"offset": np.array(2)}, jax.random.key(0))
    checkpoints.wait()
    checkpoints.close()
    return changed


@pytest.mark.parametrize("kind", ["truncated arrays", "garbled meta JSON",
                                  "garbled model metadata JSON", "deleted array files"])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_its_step_saved_again(runs, caplog,
                                                                             kind):
    tmp, a, b = runs
    run_dir = tmp / f"damaged-{kind.replace(' ', '-')}"
    changed = _save_3_and_6(run_dir, a.state)
    _damage(run_dir / "checkpoints" / "6", kind)
    damaged_files = _files(run_dir / "checkpoints" / "6")
    checkpoints = Checkpoints(run_dir, keep=3)
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        restored = checkpoints.restore(b.state)
    assert restored.step == 3 and int(restored.data["offset"]) == 1
    _assert_same(_host(a.state), _host(restored.state))
    # Moved, whole and untouched, out of orbax's directory; the warning says where to.
    moved = run_dir / "checkpoints_damaged" / "6"
    assert _files(moved) == damaged_files
    assert checkpoints.steps() == [3]
    assert "checkpoint 6" in caplog.text and str(moved) in caplog.text
    assert "fell back to checkpoint 3" in caplog.text

    # The resumed run saves step 6 again, and the next start resumes from it without a word.
    checkpoints.save(6, changed, {"offset": np.array(2)}, jax.random.key(0))
    checkpoints.wait()
    checkpoints.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        again = Checkpoints(run_dir).restore(b.state)
    assert again.step == 6 and int(again.data["offset"]) == 2
    _assert_same(_host(changed), _host(again.state))
    assert not caplog.records
    assert _files(moved) == damaged_files


def test_the_policy_alone_falls_back_too_but_never_from_an_asked_for_step(runs, caplog):
    tmp, a, b = runs
    run_dir = tmp / "policy"
    _save_3_and_6(run_dir, a.state)
    _damage(run_dir / "checkpoints" / "6", "truncated arrays")
    # A step asked for (eval/export --step 6) is not replaced by another, and stays in place.
    with pytest.raises(RestoreError, match=r"checkpoint 6 in .* cannot be read .*left in place"):
        restore_policy(run_dir, b.state, step=6)
    assert Checkpoints(run_dir).steps() == [3, 6]
    # Without a step: the one before, the damaged one moved aside (next to an earlier one).
    (run_dir / "checkpoints_damaged" / "6").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        step, state = restore_policy(run_dir, b.state)
    assert step == 3
    _assert_same(_host(a.state["model"]), _host(state["model"]))
    assert (run_dir / "checkpoints_damaged" / "6-1" / "model").is_dir()
    assert str(run_dir / "checkpoints_damaged" / "6-1") in caplog.text
    assert Checkpoints(run_dir).steps() == [3]


def test_when_no_checkpoint_can_be_read_it_is_an_error_and_nothing_is_moved(runs):
    tmp, a, b = runs
    run_dir = tmp / "unreadable"
    _save_3_and_6(run_dir, a.state)
    # A model of another shape fits no checkpoint: that is not damage, so nothing moves.
    wider = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype),
                         b.state["model"])
    with pytest.raises(RestoreError, match=r"(?s)could be read.*step 6: .*step 3: "):
        Checkpoints(run_dir).restore_model(wider)
    for step in ("3", "6"):
        _damage(run_dir / "checkpoints" / step, "truncated arrays")
    with pytest.raises(RestoreError, match=r"(?s)could be read.*step 6: .*step 3: "):
        Checkpoints(run_dir).restore(b.state)
    # When none can be read, that is an error, not a fresh start; and nothing was moved.
    assert Checkpoints(run_dir).steps() == [3, 6]
    assert not (run_dir / "checkpoints_damaged").exists()


def test_an_unfinished_save_is_not_a_checkpoint(runs):
    tmp, a, _ = runs
    checkpoints = Checkpoints(tmp / "partial", keep=3)
    checkpoints.save(2, a.state, {"offset": np.array(0)}, jax.random.key(0))
    checkpoints.wait()
    # What a process killed mid-save leaves: orbax's temporary directory, never renamed.
    (tmp / "partial" / "checkpoints" / "4.orbax-checkpoint-tmp-123").mkdir()
    assert Checkpoints(tmp / "partial").steps() == [2]
