"""A LoRA run (model.lora) on the 8-device test mesh, with a KL term (reference = the base):
only adapters get optimizer state; checkpoints hold the adapters and a reference to the base
(path, hash), and resuming on another base is refused; `jaxrl export --adapter` writes a PEFT
directory that `peft` loads onto the HF base with jaxrl's logits (fp32, 1e-5)."""

import json
import shutil

import jax
import numpy as np
import peft  # the dev extra's (pyproject.toml): CI runs these tests, never skips them
import pytest
import torch
import transformers
from flax import nnx
from rich.console import Console

from jaxrl.cli import main
from jaxrl.config import OptimSection
from jaxrl.models import Transformer, from_pretrained, save_pretrained
from jaxrl.models.lora_config import LORA_MODULES, LoraConfig
from jaxrl.run import loop
from jaxrl.saved.checkpoint import BaseMismatchError, base_reference
from jaxrl.saved.policy import load_run_policy
from jaxrl.step.optimizer import make_optimizer
from jaxrl.step.state import TrainState
from tests.run.test_loop import NO_FLOPS, _config

LORA = [NO_FLOPS, "log.plot=false", "log.tensorboard=false", "eval.num_prompts=0",
        "train.save_final=false", "train.checkpoint_every=1", "model.lora.rank=4",
        "model.lora.alpha=8", "model.lora.target_modules=[.*_proj]", "optim.lr=0.05",
        "optim.warmup_steps=0", "algo.loss.beta=0.05"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    loop.train(_config(tmp, *LORA, "train.max_steps=2"), Console(quiet=True))
    return tmp


def test_only_adapters_have_optimizer_state(tiny_config):
    config = tiny_config("qwen2", lora=LoraConfig(2, 4.0, LORA_MODULES))
    ts = TrainState(Transformer(config, rngs=nnx.Rngs(0)), make_optimizer(OptimSection()))
    moments = [(p, v) for p, v in nnx.to_flat_state(nnx.state(ts.optimizer))
               if v.ndim > 0]
    adapters = nnx.to_flat_state(nnx.state(ts.model, nnx.LoRAParam))
    assert moments and all("lora" in p for p, _ in moments)
    assert sum(v.size for _, v in moments) == 2 * sum(v.size for _, v in adapters)


def test_checkpoint_holds_the_adapters_and_the_base_reference(lora_run):
    step_dir = lora_run / "run" / "checkpoints" / "2"
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    assert meta["base_model"] == base_reference(lora_run / "run" / "init_model")
    saved = (step_dir / "model" / "_METADATA").read_text()
    assert "lora" in saved and "embed" not in saved and "qkv_kernel" not in saved


def test_resuming_on_another_base_is_refused(lora_run, tmp_path):
    shutil.copytree(lora_run / "run", tmp_path / "run")
    base = from_pretrained(tmp_path / "run" / "init_model")
    base.embed[...] = base.embed[...] * 1.01
    save_pretrained(base, tmp_path / "run" / "init_model")
    with pytest.raises(BaseMismatchError, match="trained on the base model"):
        loop.train(_config(tmp_path, *LORA, "train.max_steps=3"), Console(quiet=True))


def test_exported_adapter_loads_with_peft_on_the_base_with_jaxrl_logits(lora_run, tmp_path):
    run = lora_run / "run"
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    _, policy, model_dir = load_run_policy(run)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids_BxT = np.random.default_rng(0).integers(0, policy.config.vocab_size, (2, 7))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids_BxT)).logits.numpy()
    got = np.asarray(policy(jax.numpy.asarray(ids_BxT)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Two updates moved the adapters: the export is not the base model's identity.
    base_logits = np.asarray(from_pretrained(model_dir)(jax.numpy.asarray(ids_BxT)))
    assert np.abs(got - base_logits).max() > 1e-4
