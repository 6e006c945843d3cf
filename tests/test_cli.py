"""The `jaxrl` command: dispatch, exit status 2 on bad input, the console script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.cli import EXIT_CONFIG_ERROR, main

ROOT = Path(__file__).resolve().parents[1]
CHECK_YAML = str(ROOT / "configs" / "check.yaml")


@pytest.mark.parametrize("args, words", [
    (["check", CHECK_YAML, "check.famly=llama"], ["check.famly", "family"]),
    (["check", CHECK_YAML, "check.family=gpt2"], ["gpt2", "qwen3"]),
    (["check", "sharding.layout=nope"], ["nope", "fsdp_tp"]),
    (["check", "model.path=/no/such/dir"], ["/no/such/dir"]),
])
def test_bad_input_exits_2_naming_it(args, words, capsys):
    assert main(args) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def test_layout_that_does_not_fit_the_devices_exits_2(tmp_path, capsys):
    layout = tmp_path / "three.yaml"
    layout.write_text("mesh: {data: 3, fsdp: 1, tensor: 1}\n")
    assert main(["check", f"sharding.layout={layout}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "needs 3 devices" in err and "8 are available" in err


@pytest.mark.process
def test_console_script_as_the_readme_runs_it():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    jaxrl = Path(sys.executable).parent / "jaxrl"
    result = subprocess.run([str(jaxrl), "check", "configs/check.yaml", "sharding.layout=fsdp_tp"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["ok"] is True
    assert "layers.*.attn.qkv_kernel" in result.stderr and "check passed" in result.stderr


def test_broken_checkpoint_exits_2_naming_the_tensor(tmp_path, capsys):
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from jaxrl.models import Transformer, save_pretrained
    from jaxrl.models.config import tiny_config

    save_pretrained(Transformer(tiny_config("llama"), rngs=nnx.Rngs(0)), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert main(["check", f"model.path={tmp_path}"]) == EXIT_CONFIG_ERROR
    assert "model.norm.weight" in capsys.readouterr().err


def _raised_from(error: BaseException, cause: BaseException) -> BaseException:
    """`error` as `raise error from cause` leaves it."""
    try:
        raise error from cause
    except BaseException as e:
        return e


def _failing(monkeypatch, error: BaseException) -> None:
    """Makes `jaxrl check` raise `error` (as a bug, a Ctrl-C or a full disk would)."""
    import jaxrl.cli as cli

    def run(args, console):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "check", (run, "fails"))


def _noted(error, note):
    error.add_note(note)
    return error


@pytest.mark.parametrize("error, status, words", [
    (RuntimeError("boom in user code"), 1,
     ["error: RuntimeError: boom in user code", "--debug or JAXRL_DEBUG=1"]),
    (KeyboardInterrupt(), 130, ["interrupted (Ctrl-C)"]),
    # The asynchronous step notes which side failed (jaxrl.step.asynchronous).
    (_noted(_noted(ZeroDivisionError("reward of an empty answer"), "-----\nJAX's note"),
            "async: the train side failed at step 3; the rollout side stops too"), 1,
     ["error: ZeroDivisionError: reward of an empty answer; async: the train side failed at "
      "step 3; the rollout side stops too (rerun with --debug"]),
    (OSError(28, "No space left on device", "/runs/x/metrics.jsonl"), 1,
     ["the disk is full", "/runs/x/metrics.jsonl", "resumes from its last checkpoint"]),
    (PermissionError(13, "Permission denied", "/runs/x"), 2,
     ["permission denied: /runs/x"]),
    # An asynchronous checkpoint save (orbax, tensorstore) reports a full disk as text, or
    # re-raises it from the OSError.
    (ValueError("INTERNAL: Error writing local file \"/runs/x/checkpoints/7/d/0\": "
                "[OS error 28: No space left on device]"), 1,
     ["the disk is full", "a checkpoint or a log", "OS error 28", "resumes from its last"]),
    (_raised_from(RuntimeError("save failed"),
                  OSError(28, "No space left on device", "/runs/x/checkpoints/3")), 1,
     ["the disk is full: writing /runs/x/checkpoints/3 failed"]),
])
def test_every_failure_is_one_line_and_an_exit_status(monkeypatch, capsys, error, status, words):
    _failing(monkeypatch, error)
    monkeypatch.delenv("JAXRL_DEBUG", raising=False)
    assert main(["check"]) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)


def test_a_system_exit_inside_a_command_passes_through_with_its_status(monkeypatch, capsys):
    """Not a failure of the command (no error line): its status is the process's."""
    _failing(monkeypatch, SystemExit(7))
    with pytest.raises(SystemExit) as raised:
        main(["check"])
    assert raised.value.code == 7 and "error" not in capsys.readouterr().err


def test_debug_shows_the_traceback(monkeypatch, capsys):
    _failing(monkeypatch, ValueError("deep inside"))
    assert main(["check", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: deep inside" in err
    monkeypatch.setenv("JAXRL_DEBUG", "1")
    assert main(["check"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.process
@pytest.mark.parametrize("content, words", [
    ("- a\n- b\n", ["must hold a mapping of keys", "got a YAML list"]),
    ("train:\n  max_steps: [\n", ["is not valid YAML at line 3, column 1"]),
])
def test_a_broken_config_file_exits_2_without_a_traceback(tmp_path, content, words):
    path = tmp_path / "exp.yaml"
    path.write_text(content)
    result = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == EXIT_CONFIG_ERROR, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"config file {str(path)!r}" in result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_a_truncated_safetensors_file_exits_2_naming_it(tmp_path, capsys):
    from flax import nnx

    from jaxrl.models import Transformer, save_pretrained
    from jaxrl.models.config import tiny_config

    save_pretrained(Transformer(tiny_config("llama"), rngs=nnx.Rngs(0)), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # an interrupted download
    assert main(["check", f"model.path={tmp_path}"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert str(weights) in err and "truncated or corrupted" in err, err
