"""Evaluation: the pass@k estimator against enumeration, the `eval` section's checks, and
`evaluate` on a tiny random addition policy on 8 devices (metrics, grouping of samples by
prompt, batch-size invariance, the policy read from `run.state`, eval.jsonl)."""

import dataclasses
import itertools
import json
from math import comb

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from jaxrl.config import ConfigError, load_config
from jaxrl.rl import JaxReward
from jaxrl.train.evaluate import EVAL_FILE, Evaluator, append_eval, evaluate, pass_at_k
from jaxrl.train.experiment import EvalSection, ExperimentConfig
from jaxrl.train.run import build_run
from tests.test_shipped_configs import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TINY = ["sharding.layout=fsdp", "data.batch_size=8", "data.num_prompts=64",
        "rollout.num_generations=4", "algo.num_minibatches=2", "perf.count_flops=false",
        "log.plot=false", "log.tensorboard=false", "eval.num_prompts=20", "eval.batch_size=8"]
SAMPLED = dict(num_samples=4, temperature=1.0, k=[1, 2, 4])


def brute_force_pass_at_k(n, c, k):
    """The fraction of k-subsets of n samples (the first c solved) holding a solved one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_the_fraction_of_k_subsets_holding_a_solved_sample(n):
    for k in range(1, n + 1):
        c_N = np.arange(n + 1)
        want_N = [brute_force_pass_at_k(n, c, k) for c in c_N]
        np.testing.assert_allclose(pass_at_k(c_N, n, k), want_N, rtol=0, atol=1e-12)
        np.testing.assert_allclose(want_N, [1 - comb(n - c, k) / comb(n, k) for c in c_N])


def test_pass_at_k_is_stable_for_large_n_and_checks_its_arguments():
    # C(199, 100) / C(200, 100) = 100 / 200: binomials near 1e59 never form.
    assert pass_at_k(np.array([1]), 200, 100)[0] == pytest.approx(0.5, abs=1e-12)
    # pass@1 is the solved fraction; pass@n whether any sample solved it.
    np.testing.assert_allclose(pass_at_k(np.array([0, 3, 10]), 10, 1), [0, 0.3, 1])
    np.testing.assert_array_equal(pass_at_k(np.array([0, 1, 10]), 10, 10), [0, 1, 1])
    with pytest.raises(ValueError, match=r"k in \[1, n=4\], got k=5"):
        pass_at_k(np.array([1]), 4, 5)
    with pytest.raises(ValueError, match=r"\[0, n=4\]"):
        pass_at_k(np.array([5]), 4, 1)


@pytest.mark.parametrize("values, words", [
    (dict(num_samples=4), ["eval.num_samples=4", "eval.temperature > 0", "identical"]),
    (dict(k=[2]), ["eval.k", "[1, eval.num_samples=1]", "[2]"]),
    (dict(num_samples=4, temperature=1.0, k=[1, 8]), ["eval.k", "num_samples=4", "[1, 8]"]),
    (dict(k=[]), ["eval.k", "non-empty"]),
    (dict(num_samples=2, temperature=1.0, k=[1, 1]), ["eval.k", "distinct"]),
    (dict(num_prompts=-1), ["eval.num_prompts", ">= 0", "-1"]),
    (dict(batch_size=0), ["eval.batch_size", ">= 1", "0"]),
    (dict(num_samples=0), ["eval.num_samples", ">= 1"]),
    (dict(every=-5), ["eval.every", "-5"]),
    (dict(temperature=-1.0), ["eval.temperature", ">= 0", "-1.0"]),
    (dict(temperature=1.0, top_p=1.5), ["eval.top_p", "1.5"]),
    (dict(temperature=1.0, top_k=0), ["eval.top_k", "0"]),
])
def test_bad_eval_values_name_the_key(values, words):
    with pytest.raises(ValueError) as info:
        EvalSection(**values)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_eval_section_loads_from_overrides_and_errors_name_the_key():
    cfg = load_config(ExperimentConfig, QUICKSTART,
                      ["eval.num_samples=8", "eval.temperature=0.7", "eval.k=[1,4,8]",
                       "eval.every=100"])
    assert cfg.eval == EvalSection(num_samples=8, temperature=0.7, k=[1, 4, 8], every=100)
    assert EvalSection() == EvalSection(num_prompts=1000, batch_size=250, num_samples=1,
                                        temperature=0.0, k=[1], every=0, seed=0)
    with pytest.raises(ConfigError, match=r"eval\.k"):
        load_config(ExperimentConfig, QUICKSTART, ["eval.k=[2]"])
    with pytest.raises(ConfigError, match="eval_prompts"):  # moved to eval.num_prompts
        load_config(ExperimentConfig, QUICKSTART, ["train.eval_prompts=10"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A random tiny addition policy (no training) on the 8-device fsdp mesh."""
    tmp = tmp_path_factory.mktemp("eval")
    cfg = load_config(ExperimentConfig, QUICKSTART, [*TINY, f"train.run_dir={tmp}"])
    return build_run(cfg, tmp, Console(stderr=True, width=200))


def with_reward(run, fn):
    """`run` scoring with the one in-graph reward fn(RewardInputs) -> r_B instead."""
    task = dataclasses.replace(run.task, rewards=lambda tokenizer: [JaxReward("test", fn)])
    return dataclasses.replace(run, task=task)


def in_unit_interval(metrics):
    return all(0 <= metrics[name] <= 1 for name in metrics if name.startswith("eval/")
               and name not in ("eval/num_prompts", "eval/num_samples"))


def test_greedy_evaluation_by_default_reports_one_sample_per_prompt(run):
    metrics = evaluate(run, run.cfg.eval)
    assert set(metrics) == {"eval/reward_mean", "eval/exact_match", "eval/pass@1",
                            "eval/num_prompts", "eval/num_samples"}
    assert metrics["eval/num_prompts"] == 20 and metrics["eval/num_samples"] == 1
    assert in_unit_interval(metrics) and metrics["eval/pass@1"] == metrics["eval/exact_match"]


def test_sampled_evaluation_gives_pass_at_k_in_unit_interval_independent_of_batches(run):
    # 20 held-out prompts in batches of 8 (the last one padded) or in one batch of 20.
    by_8 = evaluate(run, dataclasses.replace(run.cfg.eval, **SAMPLED))
    by_20 = evaluate(run, dataclasses.replace(run.cfg.eval, batch_size=20, **SAMPLED))
    assert by_8 == by_20  # each prompt samples with its own key, wherever it sits
    assert by_8["eval/num_samples"] == 4 and in_unit_interval(by_8)
    assert by_8["eval/pass@1"] == pytest.approx(by_8["eval/exact_match"])
    assert by_8["eval/pass@1"] <= by_8["eval/pass@2"] <= by_8["eval/pass@4"]
    other_seed = evaluate(run, dataclasses.replace(run.cfg.eval, seed=1, **SAMPLED))
    assert other_seed != by_8


def test_pass_at_k_rises_with_k_when_samples_of_a_prompt_differ(run):
    # Solved: the first completion token is even (~half of the samples, independently).
    even_first = with_reward(run, lambda inputs: (
        inputs.completion_ids_BxC[:, 0] % 2 == 0).astype(jnp.float32))
    metrics = evaluate(even_first, dataclasses.replace(run.cfg.eval, **SAMPLED))
    assert 0 < metrics["eval/pass@1"] < metrics["eval/pass@2"] < metrics["eval/pass@4"] <= 1
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/exact_match"])
    assert metrics["eval/reward_mean"] == pytest.approx(metrics["eval/exact_match"])


def test_samples_are_grouped_by_their_prompt(run):
    # Solved: the prompt's dataset row is even, whatever was sampled. Every prompt has all
    # of its samples solved or none, so pass@k = exact match for every k.
    even_row = with_reward(run, lambda inputs: (inputs.rows_B % 2 == 0).astype(jnp.float32))
    evaluator = Evaluator(even_row, dataclasses.replace(run.cfg.eval, **SAMPLED))
    metrics = evaluator()
    share = float(np.mean(evaluator.prompts.rows_N % 2 == 0))
    assert 0 < share < 1
    for k in (1, 2, 4):
        assert metrics[f"eval/pass@{k}"] == pytest.approx(share)
    assert metrics["eval/exact_match"] == pytest.approx(share)


def test_an_evaluator_evaluates_the_policy_now_in_run_state(run):
    even_first = with_reward(run, lambda inputs: (
        inputs.completion_ids_BxC[:, 0] % 2 == 0).astype(jnp.float32))
    evaluator = Evaluator(even_first, run.cfg.eval)
    before = evaluator()
    assert before["eval/reward_mean"] < 1
    # All-zero weights give all-zero logits: greedy decoding picks token 0, which is even.
    zeroed = jax.tree.map(lambda x: x * 0 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          even_first.state)
    even_first.state = zeroed
    assert evaluator()["eval/reward_mean"] == 1.0


def test_append_eval_adds_one_line_per_evaluation(tmp_path):
    append_eval(tmp_path, 10, {"eval/exact_match": 0.5})
    path = append_eval(tmp_path, None, {"eval/exact_match": 0.75})
    assert path == tmp_path / EVAL_FILE
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 10, "eval/exact_match": 0.5}, {"step": None, "eval/exact_match": 0.75}]


def test_a_task_without_held_out_prompts_cannot_be_evaluated(run):
    no_rows = dataclasses.replace(run, task=dataclasses.replace(run.task, eval_rows=None))
    with pytest.raises(ValueError, match="data.task=addition has no held-out prompts"):
        Evaluator(no_rows, run.cfg.eval)
    with pytest.raises(ValueError, match="eval.num_prompts must be >= 1"):
        Evaluator(run, dataclasses.replace(run.cfg.eval, num_prompts=0))
