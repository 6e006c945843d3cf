"""tests/serve needs the jetstream extra (`pip install -e '.[jetstream]'`). `.ci/run` runs
this folder, every tier of it, in a second environment that has it; in the core environment,
without the extra, the folder is not collected (test_optional_extra.py checks, with JetStream
installed, that no core module imports it)."""

import dataclasses
import importlib.util

import pytest

if importlib.util.find_spec("jetstream") is None:
    collect_ignore_glob = ["test_*.py"]

PROMPTS = ["hello", "what is 1+1?", "abc", "zebra 42", "x", "the quick brown fox", "7 + 8 = ?",
           "jax"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """`jaxrl generate`'s test policy: tiny qwen2, character tokenizer, EOS 2."""
    from tests.commands.test_generate import save_char_policy

    return save_char_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A quickstart run of 2 steps with a checkpoint at each."""
    from rich.console import Console

    from jaxrl.run import loop
    from tests.run.test_loop import NO_FLOPS, _config

    tmp = tmp_path_factory.mktemp("serve_run")
    loop.train(_config(tmp, NO_FLOPS, "log.plot=false", "log.tensorboard=false",
                       "eval.num_prompts=0", "train.save_final=false", "train.max_steps=2",
                       "train.checkpoint_every=1"), Console(quiet=True))
    return tmp / "run"


def generate_greedy(model_dir, prompts, max_new_tokens, layout="fsdp_tp"):
    """`jaxrl generate`'s greedy completions (text, token count) of `prompts`."""
    from rich.console import Console

    from jaxrl.commands.generate import GenerateConfig, run_generate
    from jaxrl.config import load_config

    cfg = load_config(GenerateConfig, None, [
        f"model.path={model_dir}", "rollout.sampling.temperature=0", f"sharding.layout={layout}",
        f"rollout.max_new_tokens={max_new_tokens}"])
    # Prompts set here, not as an override: some hold characters the override syntax reads.
    cfg = dataclasses.replace(cfg, generate=dataclasses.replace(cfg.generate,
                                                                prompts=list(prompts)))
    records = run_generate(cfg, Console(quiet=True))
    return {r["prompt"]: (r["completion"], r["num_tokens"]) for r in records}
