"""`jaxrl generate`: text in, text out, from a model directory with its own tokenizer."""

import json

import numpy as np
import pytest
from flax import nnx

from jaxrl.cli import EXIT_CONFIG_ERROR, main
from jaxrl.commands.generate import GenerateConfig, run_generate
from jaxrl.config import load_config
from jaxrl.data.tokenizer import completion_end_ids, make_char_tokenizer
from jaxrl.models import Transformer, save_pretrained
from jaxrl.models.config import tiny_config

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"


def save_char_policy(path):
    """A tiny qwen2 policy with a character tokenizer (EOS 2), saved in HF format at `path`."""
    tokenizer = make_char_tokenizer(ALPHABET)
    config = tiny_config("qwen2", vocab_size=len(tokenizer), eos_token_id=2)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_char_policy(tmp_path_factory.mktemp("policy"))


def test_generate_prints_completions_per_prompt(model_dir, capsys):
    args = ["generate", f"model.path={model_dir}", "generate.prompts=[hello,what is 1+1?]",
            "rollout.num_generations=2", "rollout.max_new_tokens=8", "sharding.layout=fsdp_tp"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("### prompt") == 2 and out.count("--- completion") == 4
    assert "### prompt 1: what is 1+1?" in out


def test_generate_is_reproducible_and_greedy_rows_agree(model_dir, capsys):
    overrides = [f"model.path={model_dir}", "generate.prompts=[abc]", "rollout.sampling.temperature=0",
                 "rollout.num_generations=3", "rollout.max_new_tokens=6", "sharding.layout=fsdp"]
    cfg = load_config(GenerateConfig, None, overrides)
    first = run_generate(cfg, console=_quiet())
    again = run_generate(cfg, console=_quiet())
    assert first == again
    # Greedy: every sample of the group is the same completion.
    assert len({r["completion"] for r in first}) == 1
    assert all(0 < r["num_tokens"] <= 6 for r in first)


def test_stop_ids_merge_tokenizer_model_and_config(model_dir):
    from jaxrl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    config = tiny_config("qwen2", eos_token_id=(2, 7))
    assert completion_end_ids(tokenizer, config, [9, 2]) == (2, 7, 9)


def test_generate_needs_a_model_directory_with_a_tokenizer(tmp_path, capsys):
    assert main(["generate"]) == EXIT_CONFIG_ERROR
    assert "model.path" in capsys.readouterr().err
    save_pretrained(Transformer(tiny_config("llama"), rngs=nnx.Rngs(0)), tmp_path)
    assert main(["generate", f"model.path={tmp_path}"]) == EXIT_CONFIG_ERROR
    assert "no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("override, words", [
    ("rollout.sampling.temperature=-1", ["rollout.sampling.temperature", "-1"]),
    ("rollout.sampling.top_p=1.5", ["rollout.sampling.top_p", "1.5"]),
    ("rollout.max_new_tokens=0", ["rollout.max_new_tokens", "0"]),
    ("generate.prompts=[]", ["generate.prompts", "empty"]),
])
def test_bad_sampling_settings_exit_2(override, words, model_dir, capsys):
    assert main(["generate", f"model.path={model_dir}", override]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    for word in words:
        assert word in err, (word, err)


def _quiet():
    from rich.console import Console

    return Console(quiet=True)


def test_records_are_json_serialisable(model_dir):
    cfg = load_config(GenerateConfig, None, [f"model.path={model_dir}", "rollout.max_new_tokens=4"])
    records = run_generate(cfg, console=_quiet())
    assert json.loads(json.dumps(records)) == records
    assert np.all([r["num_tokens"] <= 4 for r in records])
