"""Evaluation: the pass@k estimator against enumeration, the `eval` section's checks, and
`evaluate` on a tiny random addition policy on 8 devices (metrics, grouping of samples by
prompt, batch-size invariance, the parameters it is given, "solved" with a negative-weight
reward, eval.jsonl)."""

import dataclasses
import itertools
import json
from math import comb

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from jaxrl.config import ConfigError, EvalSection, ExperimentConfig, load_config
from jaxrl.rl import JaxReward
from jaxrl.rollout.settings import SamplingParams
from jaxrl.run.build import build_run, policy
from jaxrl.run.evaluate import Evaluator, append_eval, pass_at_k
from jaxrl.saved.files import EVAL_FILE
from jaxrl.step.learner import prompt_success
from tests.test_shipped_configs import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TINY = ["sharding.layout=fsdp", "data.batch_size=8", "data.num_prompts=64",
        "rollout.num_generations=4", "algo.num_minibatches=2", "perf.count_flops=false",
        "log.plot=false", "log.tensorboard=false", "eval.num_prompts=20", "eval.batch_size=8"]
SAMPLED = dict(num_samples=4, sampling=SamplingParams(1.0), k=[1, 2, 4])


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
    (dict(num_samples=4), ["eval.num_samples=4", "eval.sampling.temperature > 0", "identical"]),
    (dict(k=[2]), ["eval.k", "[1, eval.num_samples=1]", "[2]"]),
    (dict(num_samples=4, sampling=SamplingParams(1.0), k=[1, 8]), ["eval.k", "num_samples=4", "[1, 8]"]),
    (dict(k=[]), ["eval.k", "non-empty"]),
    (dict(num_samples=2, sampling=SamplingParams(1.0), k=[1, 1]), ["eval.k", "distinct"]),
    (dict(num_prompts=-1), ["eval.num_prompts", ">= 0", "-1"]),
    (dict(batch_size=0), ["eval.batch_size", ">= 1", "0"]),
    (dict(num_samples=0), ["eval.num_samples", ">= 1"]),
    (dict(every=-5), ["eval.every", "-5"]),
])
def test_bad_eval_values_name_the_key(values, words):
    with pytest.raises(ValueError) as info:
        EvalSection(**values)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("override, words", [
    ("eval.sampling.temperature=-1.0", ["eval.sampling.temperature", ">= 0", "-1.0"]),
    ("eval.sampling.top_p=1.5", ["eval.sampling.top_p", "1.5"]),
    ("eval.sampling.top_k=0", ["eval.sampling.top_k", "0"]),
])
def test_bad_eval_sampling_names_the_key(override, words):
    """eval.sampling is the sampler's SamplingParams: the loader names the key it sits at."""
    with pytest.raises(ConfigError) as info:
        load_config(ExperimentConfig, QUICKSTART, [override])
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_eval_section_loads_from_overrides_and_errors_name_the_key():
    cfg = load_config(ExperimentConfig, QUICKSTART,
                      ["eval.num_samples=8", "eval.sampling.temperature=0.7", "eval.k=[1,4,8]",
                       "eval.every=100"])
    assert cfg.eval == EvalSection(num_samples=8, sampling=SamplingParams(0.7), k=[1, 4, 8],
                                   every=100)
    assert EvalSection() == EvalSection(num_prompts=1000, batch_size=250, num_samples=1,
                                        sampling=SamplingParams(0.0), k=[1], every=0, seed=0)
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


def evaluate(run_state, cfg, params=None):
    """The evaluation of `run_state`'s policy (or of `params`) under `cfg`."""
    run, state = run_state
    return Evaluator(run, cfg)(policy(run.step, state)[1] if params is None else params)


def with_rewards(run_state, *rewards):
    """`run_state` scoring with the in-graph `rewards` instead."""
    run, state = run_state
    task = dataclasses.replace(run.task, rewards=lambda tokenizer: list(rewards))
    return dataclasses.replace(run, task=task), state


def with_reward(run_state, fn):
    """`run_state` scoring with the one in-graph reward fn(RewardInputs) -> r_B instead."""
    return with_rewards(run_state, JaxReward("test", fn))


def odd_first(inputs):
    return (inputs.completion_ids_BxC[:, 0] % 2 == 1).astype(jnp.float32)


def in_unit_interval(metrics):
    return all(0 <= metrics[name] <= 1 for name in metrics if name.startswith("eval/")
               and name not in ("eval/num_prompts", "eval/num_samples"))


def test_greedy_evaluation_by_default_reports_one_sample_per_prompt(run):
    metrics = evaluate(run, run[0].cfg.eval)
    assert set(metrics) == {"eval/reward_mean", "eval/exact_match", "eval/pass@1",
                            "eval/num_prompts", "eval/num_samples"}
    assert metrics["eval/num_prompts"] == 20 and metrics["eval/num_samples"] == 1
    assert in_unit_interval(metrics) and metrics["eval/pass@1"] == metrics["eval/exact_match"]


def test_sampled_evaluation_gives_pass_at_k_in_unit_interval_independent_of_batches(run):
    # 20 held-out prompts in batches of 8 (the last one padded) or in one batch of 20.
    by_8 = evaluate(run, dataclasses.replace(run[0].cfg.eval, **SAMPLED))
    by_20 = evaluate(run, dataclasses.replace(run[0].cfg.eval, batch_size=20, **SAMPLED))
    assert by_8 == by_20  # each prompt samples with its own key, wherever it sits
    assert by_8["eval/num_samples"] == 4 and in_unit_interval(by_8)
    assert by_8["eval/pass@1"] == pytest.approx(by_8["eval/exact_match"])
    assert by_8["eval/pass@1"] <= by_8["eval/pass@2"] <= by_8["eval/pass@4"]
    other_seed = evaluate(run, dataclasses.replace(run[0].cfg.eval, seed=1, **SAMPLED))
    assert other_seed != by_8


def test_pass_at_k_rises_with_k_when_samples_of_a_prompt_differ(run):
    # Solved: the first completion token is even (~half of the samples, independently).
    even_first = with_reward(run, lambda inputs: (
        inputs.completion_ids_BxC[:, 0] % 2 == 0).astype(jnp.float32))
    metrics = evaluate(even_first, dataclasses.replace(run[0].cfg.eval, **SAMPLED))
    assert 0 < metrics["eval/pass@1"] < metrics["eval/pass@2"] < metrics["eval/pass@4"] <= 1
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/exact_match"])
    assert metrics["eval/reward_mean"] == pytest.approx(metrics["eval/exact_match"])


def test_samples_are_grouped_by_their_prompt(run):
    # Solved: the prompt's dataset row is even, whatever was sampled. Every prompt has all
    # of its samples solved or none, so pass@k = exact match for every k.
    even_row = with_reward(run, lambda inputs: (inputs.rows_B % 2 == 0).astype(jnp.float32))
    evaluator = Evaluator(even_row[0], dataclasses.replace(run[0].cfg.eval, **SAMPLED))
    metrics = evaluator(policy(run[0].step, run[1])[1])
    share = float(np.mean(evaluator.prompts.rows_N % 2 == 0))
    assert 0 < share < 1
    for k in (1, 2, 4):
        assert metrics[f"eval/pass@{k}"] == pytest.approx(share)
    assert metrics["eval/exact_match"] == pytest.approx(share)


def test_an_evaluator_evaluates_the_parameters_it_is_given(run):
    even_run, state = with_reward(run, lambda inputs: (
        inputs.completion_ids_BxC[:, 0] % 2 == 0).astype(jnp.float32))
    evaluator = Evaluator(even_run, run[0].cfg.eval)
    params = policy(even_run.step, state)[1]
    assert evaluator(params)["eval/reward_mean"] < 1
    # All-zero weights give all-zero logits: greedy decoding picks token 0, which is even.
    zeroed = jax.tree.map(lambda x: x * 0 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          params)
    assert evaluator(zeroed)["eval/reward_mean"] == 1.0


def test_a_negative_weight_reward_counts_solved_at_its_best_like_training(run):
    # "right" is always 1; a penalty (weight -0.5) is 1 where the first token is even. The
    # highest total is 1 (penalty 0): only odd-first samples are solved, as training's
    # per-prompt success counts them (`RewardSet.solved`), not every sample at 1 - 0.5.
    cfg = dataclasses.replace(run[0].cfg.eval, **SAMPLED)
    penalised = with_rewards(
        run, JaxReward("right", lambda inputs: jnp.ones(inputs.rows_B.shape, jnp.float32)),
        JaxReward("penalty", lambda inputs: 1.0 - odd_first(inputs), weight=-0.5))
    odd = evaluate(with_reward(run, odd_first), cfg)
    metrics = evaluate(penalised, cfg)
    assert 0 < odd["eval/exact_match"] < 1
    assert metrics["eval/exact_match"] == odd["eval/exact_match"]
    rewards = penalised[0].task.reward_set(penalised[0].tokenizer, penalised[0].task.train_rows)
    total_B = jnp.array([1.0, 0.5, 1.0, 0.5])
    np.testing.assert_array_equal(prompt_success(rewards, total_B, 2), [0.5, 0.5])


def test_append_eval_adds_one_line_per_evaluation(tmp_path):
    append_eval(tmp_path, 10, {"eval/exact_match": 0.5})
    path = append_eval(tmp_path, None, {"eval/exact_match": 0.75})
    assert path == tmp_path / EVAL_FILE
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 10, "eval/exact_match": 0.5}, {"step": None, "eval/exact_match": 0.75}]


def test_a_task_without_held_out_prompts_cannot_be_evaluated(run):
    built = run[0]
    no_rows = dataclasses.replace(built, task=dataclasses.replace(built.task, eval_rows=None))
    with pytest.raises(ValueError, match="data.task=addition has no held-out prompts"):
        Evaluator(no_rows, built.cfg.eval)
    with pytest.raises(ValueError, match="eval.num_prompts must be >= 1"):
        Evaluator(built, dataclasses.replace(built.cfg.eval, num_prompts=0))
