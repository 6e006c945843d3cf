"""`jaxrl check`: a tiny model on the mesh, saved as HF and reloaded, sharded ≡ one device."""

import json
from pathlib import Path

from flax import nnx

from jaxrl.cli import main
from jaxrl.models import Transformer, save_pretrained

CHECK_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "check.yaml")


def test_check_runs_sharded_and_matches_one_device(capsys):
    assert main(["check", CHECK_YAML, "check.family=llama", "model.scan_layers=true",
                 "sharding.layout=fsdp_tp"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert summary["max_abs_diff"] <= 1e-4


def test_check_loads_a_model_directory(tmp_path, capsys, tiny_config):
    save_pretrained(Transformer(tiny_config("mistral"), rngs=nnx.Rngs(3)), tmp_path)
    assert main(["check", f"model.path={tmp_path}", "sharding.layout=fsdp"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] and summary["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert summary["num_params"] == tiny_config("mistral").num_params()
