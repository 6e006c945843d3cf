"""Every shipped experiment config and layout preset loads into its schema, and every real
recipe runs: two steps with its model swapped for a tiny random one of the same family and
its data for a small local jsonl in the recipe's format, so recipes cannot rot."""

import json
import string
from pathlib import Path

import pytest
from flax import nnx

from jaxrl.cli import main
from jaxrl.commands.check import CheckConfig
from jaxrl.commands.generate import GenerateConfig
from jaxrl.config import ExperimentConfig, load_config
from jaxrl.data.tasks import gsm8k
from jaxrl.data.tokenizer import make_char_tokenizer
from jaxrl.models import Transformer, save_pretrained
from jaxrl.sharding import resolve_layout
from tests.conftest import make_tiny_config

ROOT = Path(__file__).resolve().parents[1]
# Real recipes and the model family each one trains.
RECIPES = {"grpo_gsm8k_qwen2.5-1.5b.yaml": "qwen2", "dapo_gsm8k_llama3.2-3b.yaml": "llama",
           "grpo_gsm8k_qwen3-30b-a3b.yaml": "qwen3_moe",
           "ppo_gsm8k_qwen2.5-0.5b.yaml": "qwen2",
           "lora_grpo_gsm8k_llama3.2-1b.yaml": "llama"}
SCHEMAS = {"check.yaml": CheckConfig, "generate.yaml": GenerateConfig,
           "quickstart.yaml": ExperimentConfig, "tool_multiplication.yaml": ExperimentConfig,
           **dict.fromkeys(RECIPES, ExperimentConfig)}
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_every_config_has_a_schema():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(SCHEMAS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_config_loads_and_names_a_real_layout(name):
    cfg = load_config(SCHEMAS[name], ROOT / "configs" / name)
    assert isinstance(cfg, SCHEMAS[name])
    resolve_layout(cfg.sharding.layout)


def _tiny_model_dir(path: Path, family: str) -> Path:
    """A random tiny `family` model with a character tokenizer that has a chat template."""
    tokenizer = make_char_tokenizer(string.printable)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = make_tiny_config(family, vocab_size=len(tokenizer), max_position_embeddings=512,
                              eos_token_id=tokenizer.eos_token_id,
                              bos_token_id=tokenizer.bos_token_id)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), path)
    tokenizer.save_pretrained(str(path))
    return path


def _gsm8k_jsonl(path: Path) -> Path:
    """GSM8K's format: a question column and a worked answer ending in '#### <number>'.

    The first row is too long for any recipe's max_prompt_len: it is dropped, so dataset row
    indices and prompt positions differ from there on.
    """
    rows = [{"question": "Tom has many apples. " * 40, "answer": "#### 0"}]
    rows += [{"question": f"Tom has {a} apples and buys {b} more. How many now?",
              "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"}
             for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (6, 9), (20, 22), (5, 5)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _answer_matches_question(prompt, completion, fields):
    """1 if the answer field handed to the reward belongs to this prompt's question."""
    a, b = (int(w) for w in prompt.split() if w.isdigit())
    return float(fields["answer"].endswith(f"#### {a + b}"))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_runs_two_steps_on_a_tiny_model(name, tmp_path, capsys, monkeypatch):
    # The recipes' math reward would score a random policy 0 whatever it is handed; this
    # stand-in checks that each sample gets the answer of its own dataset row.
    monkeypatch.setattr(gsm8k, "math_reward", _answer_matches_question)
    model_dir = _tiny_model_dir(tmp_path / "model", RECIPES[name])
    data = _gsm8k_jsonl(tmp_path / "train.jsonl")
    run_dir = tmp_path / "run"
    recipe = load_config(ExperimentConfig, ROOT / "configs" / name)
    # A shrunk budget keeps the recipe's overlong shaping on, over a shrunk soft zone.
    overlong = [] if recipe.algo.overlong_buffer is None else ["algo.overlong_buffer=4"]
    # The prompts hold at most 142 tokens (the first row, longer, is still dropped): a budget
    # of 160 instead of the recipes' 320-384 halves the tokens the step runs.
    code = main(["train", str(ROOT / "configs" / name), f"model.path={model_dir}",
                 f"data.source={data}", f"train.run_dir={run_dir}", "train.max_steps=2",
                 "data.batch_size=4", "data.max_prompt_len=160", "rollout.max_new_tokens=8",
                 "algo.microbatch_size=4",
                 "log.tensorboard=false", "perf.count_flops=false", *overlong])
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert record["reward/math"] == 1 and record["reward/errors"] == 0
        assert record["completion/len_mean"] > 0
        assert ("reward/overlong" in record) == bool(overlong)
        assert ("value/loss" in record) == (recipe.algo.advantage == "gae")
    saved = load_config(ExperimentConfig, run_dir / "config.yaml")
    assert saved.model.path == str(model_dir) and saved.data.task == "gsm8k"
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["prompts_dropped"] == 1
