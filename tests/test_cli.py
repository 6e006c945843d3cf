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


def test_console_script_as_the_readme_runs_it():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    jaxrl = Path(sys.executable).parent / "jaxrl"
    result = subprocess.run([str(jaxrl), "check", "configs/check.yaml", "sharding.layout=fsdp_tp"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["ok"] is True
    assert "layers.*.attn.q_kernel" in result.stderr and "check passed" in result.stderr


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
