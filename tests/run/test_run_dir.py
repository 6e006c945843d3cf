"""Claiming a run directory: a user's folder is never written into, two runs never share one,
a start killed before its first step is cleared on the next, a failed start leaves nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config import ExperimentConfig, RunDirError, load_config
from jaxrl.run import run_dir as run_dirs
from jaxrl.run.run_dir import prepare_run_dir
from jaxrl.saved.files import CONFIG_FILE, MARKER_FILE

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _cfg(run_dir):
    return load_config(ExperimentConfig, QUICKSTART, [f"train.run_dir={run_dir}"])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}


@pytest.mark.process
def test_train_refuses_an_unrelated_folder_and_leaves_every_byte(tmp_path):
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    # Sentinels, among them the names a run would write.
    for name in (CONFIG_FILE, "metrics.jsonl.bak", "notes.txt", "sub/data.bin"):
        (folder / name).write_bytes(b"sentinel " + name.encode() + bytes(range(256)))
    before = _snapshot(folder)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "jaxrl.cli", "train", str(QUICKSTART), f"train.run_dir={folder}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "not a jaxrl run directory" in result.stderr and "notes.txt" in result.stderr
    assert "Traceback" not in result.stderr
    assert _snapshot(folder) == before


def test_an_empty_folder_is_claimed_with_the_marker_first(tmp_path):
    claim = prepare_run_dir(_cfg(tmp_path), "x")
    assert claim.run_dir == tmp_path and not claim.resume and claim.made is None
    marker = json.loads((tmp_path / MARKER_FILE).read_text())
    assert marker["pid"] == os.getpid()
    assert (tmp_path / CONFIG_FILE).is_file()
    # A failed start empties it again; the folder the user made stays.
    claim.release()
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []


def test_the_folders_it_made_are_removed_when_the_start_fails(tmp_path):
    claim = prepare_run_dir(_cfg(tmp_path / "a" / "b"), "x")
    assert claim.made == tmp_path / "a"
    claim.release()
    assert not (tmp_path / "a").exists()
    # A parent it made that another run has started in meanwhile stays, with that run.
    claim = prepare_run_dir(_cfg(tmp_path / "a" / "b"), "x")
    (tmp_path / "a" / "other").mkdir()
    claim.release()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["other"]


def test_a_failed_default_start_leaves_no_runs_folder(tmp_path, monkeypatch, capsys):
    from jaxrl.cli import EXIT_CONFIG_ERROR, main

    monkeypatch.chdir(tmp_path)
    assert main(["train", str(QUICKSTART), "data.task=custom", "data.reward_fn=os.path:join",
                 f"data.source={tmp_path / 'missing.jsonl'}"]) == EXIT_CONFIG_ERROR
    assert "missing.jsonl" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_two_claims_of_one_folder_cannot_both_win(tmp_path):
    run_dirs._write_marker(tmp_path)
    with pytest.raises(RunDirError, match="claimed by another run"):
        run_dirs._write_marker(tmp_path)


def test_a_start_killed_before_its_first_step_is_cleared_on_the_next(tmp_path, capsys):
    # What a SIGKILL during the build leaves: the marker (of a process now gone), the config
    # and the random policy, no metrics, no checkpoint.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (tmp_path / MARKER_FILE).write_text(json.dumps(
        {"pid": int(dead.stdout), "host": run_dirs.socket.gethostname()}))
    (tmp_path / CONFIG_FILE).write_text("half")
    (tmp_path / "init_model").mkdir()
    (tmp_path / "init_model" / "config.json").write_text("{}")
    claim = prepare_run_dir(_cfg(tmp_path), "x")
    assert not claim.resume and "interrupted before its first step" in claim.note
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER_FILE, CONFIG_FILE]


def test_a_folder_in_use_by_a_live_jaxrl_process_is_refused(tmp_path):
    # A live process whose command line names jaxrl (as a running `jaxrl train` does).
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "jaxrl"])
    try:
        (tmp_path / MARKER_FILE).write_text(json.dumps(
            {"pid": live.pid, "host": run_dirs.socket.gethostname()}))
        with pytest.raises(RunDirError, match=f"in use by a running jaxrl process \\(pid "
                                              f"{live.pid}"):
            prepare_run_dir(_cfg(tmp_path), "x")
        assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER_FILE]
    finally:
        live.kill()
        live.wait()


def test_a_file_as_run_dir_is_refused(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(RunDirError, match="is a file"):
        prepare_run_dir(_cfg(tmp_path / "f"), "x")
    assert (tmp_path / "f").read_text() == "mine"


def _as_a_user(argv: list[str]) -> list[str]:
    """`argv` run so that file modes apply: as root (CI), without the capabilities that let
    root write anywhere (setpriv, util-linux)."""
    if os.geteuid() != 0:
        return argv
    drop = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *argv]


@pytest.mark.process
@pytest.mark.parametrize("where", ["read-only run dir", "under a read-only parent"])
def test_a_folder_that_cannot_be_written_is_refused_by_name(tmp_path, where):
    locked = tmp_path / "locked"
    locked.mkdir()
    run_dir = locked if where == "read-only run dir" else locked / "new"
    locked.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    try:
        result = subprocess.run(_as_a_user(
            [sys.executable, "-m", "jaxrl.cli", "train", str(QUICKSTART),
             f"train.run_dir={run_dir}"]), cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=300)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"train.run_dir {str(run_dir)!r} cannot be written: permission denied" in \
        result.stderr, result.stderr
    assert list(locked.iterdir()) == []


def test_a_run_directory_of_an_earlier_jaxrl_still_counts(tmp_path):
    (tmp_path / CONFIG_FILE).write_text("x")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert run_dirs.is_run_dir(tmp_path)
    with pytest.raises(RunDirError, match="no checkpoint to resume from"):
        prepare_run_dir(_cfg(tmp_path), "x")


def test_a_marked_folder_holding_more_than_a_start_writes_is_not_cleared(tmp_path):
    (tmp_path / MARKER_FILE).write_text("{}")
    (tmp_path / "eval.jsonl").write_text('{"step": null}\n')  # `jaxrl eval`'s results
    with pytest.raises(RunDirError, match="holds eval.jsonl but no training run to resume"):
        prepare_run_dir(_cfg(tmp_path), "x")
    assert (tmp_path / "eval.jsonl").read_text() == '{"step": null}\n'


def test_eval_and_export_refuse_a_folder_jaxrl_did_not_make(tmp_path, capsys):
    from jaxrl.cli import EXIT_CONFIG_ERROR, main

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text("mine: 1\n")
    before = _snapshot(folder)
    assert main(["eval", str(QUICKSTART), f"train.run_dir={folder}"]) == EXIT_CONFIG_ERROR
    assert "not a jaxrl run directory" in capsys.readouterr().err
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) == EXIT_CONFIG_ERROR
    assert "is not a jaxrl run directory" in capsys.readouterr().err
    assert _snapshot(folder) == before and not (tmp_path / "out").exists()


def test_resuming_needs_the_same_experiment_and_keys_added_since_take_their_defaults(tmp_path):
    from omegaconf import OmegaConf

    from jaxrl.config import to_yaml

    cfg = _cfg(tmp_path)
    saved = OmegaConf.create(to_yaml(cfg))
    (tmp_path / CONFIG_FILE).write_text(OmegaConf.to_yaml(saved))
    run_dirs._check_same_experiment(load_config(
        ExperimentConfig, QUICKSTART, [f"train.run_dir={tmp_path}", "train.max_steps=9"]),
        tmp_path)
    with pytest.raises(RunDirError, match=r"another experiment \(optim.lr: 0.0005 -> 0.001\)"):
        run_dirs._check_same_experiment(load_config(
            ExperimentConfig, QUICKSTART, [f"train.run_dir={tmp_path}", "optim.lr=1e-3"]),
            tmp_path)
    # A run saved by a jaxrl without these keys had their defaults: it resumes, unless the new
    # config sets them otherwise.
    del saved.data["reward_bounds"], saved.algo["entropy_decay_steps"]
    (tmp_path / CONFIG_FILE).write_text(OmegaConf.to_yaml(saved))
    run_dirs._check_same_experiment(cfg, tmp_path)
    with pytest.raises(RunDirError, match=r"algo.entropy_decay_steps: 1 -> 5"):
        run_dirs._check_same_experiment(load_config(
            ExperimentConfig, QUICKSTART, [f"train.run_dir={tmp_path}",
                                           "algo.entropy_decay_steps=5"]), tmp_path)
