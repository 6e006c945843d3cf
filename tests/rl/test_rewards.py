import functools
import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.data.tasks.addition import AdditionTask, addition_reward, make_addition_tokenizer
from jaxrl.data.tokenizer import decode_completions
from jaxrl.rl import JaxReward, PythonReward, RewardInputs, RewardSet

B = 8
TASK = AdditionTask(num_digits=2)
TOKENIZER = make_addition_tokenizer()
DECODE = functools.partial(decode_completions, TOKENIZER)
PROBLEMS = TASK.sample_problems(B, seed=0)
# Completions: even rows answer right, odd rows answer "000"; row 3 is cut after one token.
COMPLETIONS = [p["answer"] if i % 2 == 0 else "000" for i, p in enumerate(PROBLEMS)]
ROWS = np.arange(100, 100 + B)  # dataset rows of the samples


def host_fields(rows_B):
    return [{"answer": PROBLEMS[int(r) - 100]["answer"], "row": int(r)} for r in rows_B]


def make_inputs() -> RewardInputs:
    prompt_ids = np.asarray([TOKENIZER.encode(p["prompt"], add_special_tokens=False)
                             for p in PROBLEMS], np.int32)
    eos = TOKENIZER.eos_token_id
    completion_ids = np.asarray([[*TOKENIZER.encode(c, add_special_tokens=False), eos, 0]
                                 for c in COMPLETIONS], np.int32)
    completion_mask = np.ones_like(completion_ids)
    completion_mask[:, -1] = 0
    completion_mask[3, 1:] = 0
    targets = TASK.answer_token_ids(TOKENIZER, [p["answer"] for p in PROBLEMS])
    return RewardInputs(
        prompt_ids_BxP=jnp.asarray(prompt_ids), prompt_mask_BxP=jnp.ones_like(prompt_ids),
        completion_ids_BxC=jnp.asarray(completion_ids),
        completion_mask_BxC=jnp.asarray(completion_mask),
        fields={"target_ids": jnp.asarray(targets)}, rows_B=jnp.asarray(ROWS, jnp.int32))


def digits_reward(inputs: RewardInputs) -> jax.Array:
    return addition_reward(inputs.completion_ids_BxC, inputs.completion_mask_BxC,
                           inputs.fields["target_ids"])


def exact(prompt, completion, fields):
    return float(completion == fields["answer"])


def length(prompt, completion, fields):
    return len(prompt) + 0.5 * len(completion)


LENGTH_BOUNDS = (0.0, 100.0)  # the prompts and completions here are short


def fails_on_zero(prompt, completion, fields):
    if completion.startswith("0"):
        raise RuntimeError(f"no zeros please: {completion}")
    return 2.0


INPUTS = make_inputs()
EXACT_BY_HAND = [float(c == p["answer"]) for p, c in zip(PROBLEMS, COMPLETIONS, strict=True)]


def mixed_set() -> RewardSet:
    return RewardSet([JaxReward("digits", digits_reward, weight=0.5),
                      PythonReward("exact", exact, weight=2.0),
                      PythonReward("length", length, weight=-0.25, bounds=LENGTH_BOUNDS)],
                     decode=DECODE, host_fields=host_fields)


def test_jax_only_set_runs_in_graph_and_jit_equals_eager():
    rewards = RewardSet([JaxReward("digits", digits_reward, weight=3.0)])
    total, metrics = jax.jit(rewards.score)(INPUTS)
    want = 3.0 * np.asarray(digits_reward(INPUTS))
    np.testing.assert_allclose(total, want, rtol=1e-6)
    eager_total, _ = rewards.score(INPUTS)
    np.testing.assert_allclose(eager_total, total, rtol=1e-6)
    assert float(metrics["reward/errors"]) == 0
    np.testing.assert_allclose(metrics["reward/digits"], want.mean() / 3.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/mean"], want.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/std"], want.std(), rtol=1e-5)
    # Even rows are right (1), odd rows get the shared leading "0" digits or less.
    assert np.all(want[::2] == 3.0) and np.all(want[1::2] < 3.0)


def test_python_only_set_in_jit_equals_calling_the_functions_by_hand():
    rewards = RewardSet([PythonReward("exact", exact),
                         PythonReward("length", length, bounds=LENGTH_BOUNDS)],
                        decode=DECODE, host_fields=host_fields)
    total, metrics = jax.jit(rewards.score)(INPUTS)
    prompts = DECODE(INPUTS.prompt_ids_BxP, INPUTS.prompt_mask_BxP)
    completions = DECODE(INPUTS.completion_ids_BxC, INPUTS.completion_mask_BxC)
    assert completions[0] == PROBLEMS[0]["answer"] and completions[3] == "0"
    fields = host_fields(ROWS)
    exact_B = [exact(p, c, f) for p, c, f in zip(prompts, completions, fields, strict=True)]
    length_B = [length(p, c, f) for p, c, f in zip(prompts, completions, fields, strict=True)]
    assert exact_B == EXACT_BY_HAND
    np.testing.assert_allclose(total, np.add(exact_B, length_B), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/exact"], np.mean(exact_B), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/length"], np.mean(length_B), rtol=1e-6)
    assert float(metrics["reward/errors"]) == 0


def test_mixed_weighted_total_is_the_weighted_sum_by_hand():
    rewards = mixed_set()
    total, metrics = jax.jit(rewards.score)(INPUTS)
    values, errors = rewards.score_host(INPUTS)
    digits = np.asarray(digits_reward(INPUTS))
    want = 0.5 * digits + 2.0 * values[0] - 0.25 * values[1]
    np.testing.assert_allclose(total, want, rtol=1e-6)
    np.testing.assert_array_equal(values[0], EXACT_BY_HAND)
    np.testing.assert_array_equal(errors, np.zeros(B))
    assert set(metrics) == {"reward/digits", "reward/exact", "reward/length",
                            "reward/errors/digits", "reward/errors/exact",
                            "reward/errors/length", "reward/errors", "reward/mean", "reward/std"}
    np.testing.assert_allclose(metrics["reward/mean"], want.mean(), rtol=1e-6)


def test_fused_equals_split_bitwise():
    rewards = mixed_set()
    fused_total, fused_metrics = jax.jit(rewards.score)(INPUTS)
    host_values = rewards.score_host(jax.device_get(INPUTS))  # between the two programs
    split_total, split_metrics = jax.jit(rewards.score)(INPUTS, host_values)
    np.testing.assert_array_equal(fused_total, split_total)
    for key in fused_metrics:
        np.testing.assert_array_equal(fused_metrics[key], split_metrics[key], err_msg=key)


def test_split_host_values_of_the_wrong_shape_are_an_error():
    values, errors = mixed_set().score_host(INPUTS)
    with pytest.raises(ValueError, match=r"host_values must have shapes \(2, 8\)"):
        mixed_set().score(INPUTS, (values[:1], errors))


def test_raising_python_reward_gives_zero_counts_errors_and_logs_once(caplog):
    rewards = RewardSet([JaxReward("digits", digits_reward),
                         PythonReward("picky", fails_on_zero, bounds=(0.0, 2.0)),
                         PythonReward("exact", exact)],
                        decode=DECODE, host_fields=host_fields)
    completions = DECODE(INPUTS.completion_ids_BxC, INPUTS.completion_mask_BxC)
    failing = np.array([c.startswith("0") for c in completions])
    assert failing.sum() > 1 and failing.sum() < B
    score = jax.jit(rewards.score)
    with caplog.at_level(logging.ERROR, logger="jaxrl.rewards"):
        for _ in range(3):  # many failing samples over several calls
            total, metrics = score(INPUTS)
            jax.block_until_ready(total)
    values, errors = rewards.score_host(INPUTS)
    np.testing.assert_array_equal(values[0], np.where(failing, np.nan, 2.0))  # NaN: failed
    np.testing.assert_array_equal(values[1], EXACT_BY_HAND)  # the other reward is unaffected
    np.testing.assert_array_equal(errors, failing.astype(np.float32))
    assert float(metrics["reward/errors"]) == float(metrics["reward/errors/picky"]) == failing.sum()
    assert float(metrics["reward/errors/exact"]) == float(metrics["reward/errors/digits"]) == 0
    want = np.asarray(digits_reward(INPUTS)) + np.where(failing, 0.0, 2.0) + EXACT_BY_HAND
    np.testing.assert_allclose(total, want, rtol=1e-6)
    records = [r for r in caplog.records if r.name == "jaxrl.rewards"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "'picky'" in message and "Traceback" in message and "no zeros please" in message
    # The first failure is also kept as text: the reward, its sample, the exception.
    j = int(np.argmax(failing))
    prompt = DECODE(INPUTS.prompt_ids_BxP, INPUTS.prompt_mask_BxP)[j]
    want = (f"PythonReward 'picky' on prompt {prompt!r} and completion {completions[j]!r}: "
            f"RuntimeError: no zeros please: {completions[j]}")
    assert rewards.first_error == want and rewards.errors == {"picky": want}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, [1.0]])
def test_non_finite_or_non_number_values_count_as_errors(bad, caplog):
    rewards = RewardSet([PythonReward("bad", lambda p, c, f: bad),
                         PythonReward("ok", lambda p, c, f: np.float64(1.5), bounds=(0, 2))],
                        decode=DECODE)
    with caplog.at_level(logging.ERROR, logger="jaxrl.rewards"):
        total, metrics = jax.jit(rewards.score)(INPUTS)
    np.testing.assert_array_equal(total, np.full(B, 1.5, np.float32))
    assert float(metrics["reward/errors"]) == B
    assert float(metrics["reward/bad"]) == 0.0
    assert len([r for r in caplog.records if r.name == "jaxrl.rewards"]) == 1


def test_python_value_outside_its_bounds_is_an_error_that_names_the_range(caplog):
    rewards = RewardSet([PythonReward("five", lambda p, c, f: 5.0),
                         PythonReward("wide", lambda p, c, f: 5.0, bounds=(-10, 10))],
                        decode=DECODE)
    with caplog.at_level(logging.ERROR, logger="jaxrl.rewards"):
        total, metrics = jax.jit(rewards.score)(INPUTS)
    np.testing.assert_array_equal(total, np.full(B, 5.0, np.float32))  # "wide" alone counts
    assert float(metrics["reward/five"]) == 0.0 and float(metrics["reward/wide"]) == 5.0
    assert float(metrics["reward/errors"]) == float(metrics["reward/errors/five"]) == B
    assert float(metrics["reward/errors/wide"]) == 0
    prompt = DECODE(INPUTS.prompt_ids_BxP, INPUTS.prompt_mask_BxP)[0]
    completion = DECODE(INPUTS.completion_ids_BxC, INPUTS.completion_mask_BxC)[0]
    want = (f"PythonReward 'five' on prompt {prompt!r} and completion {completion!r}: "
            f"returned 5.0, outside its declared range [0, 1]")
    assert rewards.errors == {"five": want} and rewards.first_error == want
    (record,) = [r for r in caplog.records if r.name == "jaxrl.rewards"]
    assert want in record.getMessage()


@pytest.mark.parametrize(("value", "failed"), [
    (0.0, False), (1.0, False), (1 + 1e-12, False),  # 1 + 1e-12 is 1 in float32
    (1.001, True), (-1e-3, True), (1e300, True)])
def test_bounds_are_inclusive_and_compared_in_float32(value, failed):
    rewards = RewardSet([PythonReward("r", lambda p, c, f: value)], decode=DECODE)
    values, errors = rewards.score_host(INPUTS)
    assert np.isnan(values).all() == failed and (errors == float(failed)).all()
    assert (rewards.first_error is not None) == failed


@pytest.mark.parametrize(("bad", "what"), [
    (float("nan"), "returned the non-finite value nan"),
    ("1.0", "returned '1.0' of type str, not a number"),
    (None, "returned None of type NoneType, not a number"),
    (-2, "returned -2.0, outside its declared range [0, 1]")])
def test_first_error_says_what_the_reward_returned_on_which_sample(bad, what):
    long_text = "x" * 100  # excerpts are cut
    rewards = RewardSet([PythonReward("bad", lambda p, c, f: bad)],
                        decode=lambda ids, mask: [long_text] * len(ids))
    rewards.score_host(INPUTS)
    excerpt = repr("x" * 60 + "...")
    assert rewards.first_error == (f"PythonReward 'bad' on prompt {excerpt} and completion "
                                   f"{excerpt}: {what}")


def test_first_errors_are_kept_once_when_threads_score_at_once(caplog):
    def boom(prompt, completion, fields):
        raise KeyError(completion)

    rewards = RewardSet([PythonReward("boom", boom), PythonReward("ok", exact)],
                        decode=DECODE, host_fields=host_fields)
    inputs = jax.device_get(INPUTS)
    with caplog.at_level(logging.ERROR, logger="jaxrl.rewards"):
        threads = [threading.Thread(target=rewards.score_host, args=(inputs,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert list(rewards.errors) == ["boom"] and "KeyError" in rewards.first_error
    assert len([r for r in caplog.records if r.name == "jaxrl.rewards"]) == 1


def test_jax_values_outside_bounds_or_non_finite_become_zero_and_count(caplog):
    values = jnp.array([0.5, 1.0, 1.5, -0.1, math.nan, math.inf, 0.0, 0.25], jnp.float32)
    rewards = RewardSet([JaxReward("wild", lambda inputs: values, weight=2.0),
                         JaxReward("signed", lambda inputs: values - 1.0, bounds=(-1.5, 0.5))])
    total, metrics = jax.jit(rewards.score)(INPUTS)
    eager_total, _ = rewards.score(INPUTS)
    np.testing.assert_array_equal(total, eager_total)
    wild = np.array([0.5, 1.0, 0, 0, 0, 0, 0.0, 0.25])  # 1.5, -0.1, nan, inf: errors
    signed = np.array([-0.5, 0.0, 0.5, -1.1, 0, 0, -1.0, -0.75])  # nan, inf: errors
    np.testing.assert_allclose(total, 2.0 * wild + signed, rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/wild"], wild.mean(), rtol=1e-6)
    assert float(metrics["reward/errors/wild"]) == 4 and float(metrics["reward/errors/signed"]) == 2
    assert float(metrics["reward/errors"]) == 6
    # The host learns of them from the step's fetched metrics.
    assert rewards.first_error is None
    with caplog.at_level(logging.ERROR, logger="jaxrl.rewards"):
        rewards.observe(7, jax.device_get(metrics))
        rewards.observe(8, jax.device_get(metrics))
    assert rewards.errors == {
        "wild": "JaxReward 'wild' returned values outside [0, 1] or non-finite on 4 samples "
                "of step 7",
        "signed": "JaxReward 'signed' returned values outside [-1.5, 0.5] or non-finite on 2 "
                  "samples of step 7"}
    assert rewards.first_error == rewards.errors["wild"]
    assert len([r for r in caplog.records if r.name == "jaxrl.rewards"]) == 2


def test_host_fields_are_looked_up_by_rows():
    seen = []

    def row_reward(prompt, completion, fields):
        seen.append(fields["row"])
        return float(fields["row"])

    rows = np.array([107, 100, 103, 103, 101, 102, 106, 105], np.int32)
    inputs = INPUTS.replace(rows_B=jnp.asarray(rows))
    rewards = RewardSet([PythonReward("row", row_reward, bounds=(0, 200))], decode=DECODE,
                        host_fields=host_fields)
    total, _ = jax.jit(rewards.score)(inputs)
    np.testing.assert_array_equal(total, rows.astype(np.float32))
    assert seen == rows.tolist()


def test_without_host_fields_python_rewards_get_empty_dicts():
    rewards = RewardSet([PythonReward("n", lambda p, c, f: float(len(f)))], decode=DECODE)
    values, errors = rewards.score_host(INPUTS)
    np.testing.assert_array_equal(values, np.zeros((1, B)))
    np.testing.assert_array_equal(errors, np.zeros(B))


def test_sharded_inputs_give_the_unsharded_result():
    rewards = mixed_set()
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(8, 1, 1), ("data", "fsdp", "tensor"))
    sharded = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))), INPUTS)
    assert len(sharded.completion_ids_BxC.sharding.device_set) == 8
    sharded_total, sharded_metrics = jax.jit(rewards.score)(sharded)
    total, metrics = jax.jit(rewards.score)(INPUTS)
    np.testing.assert_array_equal(sharded_total, total)
    for key in metrics:
        np.testing.assert_allclose(sharded_metrics[key], metrics[key], rtol=1e-6, err_msg=key)


def test_vmap_over_batches_runs_the_callback_per_batch():
    rewards = mixed_set()
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), INPUTS)
    totals, _ = jax.jit(jax.vmap(rewards.score))(stacked)
    total, _ = jax.jit(rewards.score)(INPUTS)
    np.testing.assert_allclose(totals, jnp.stack([total, total]), rtol=1e-6)


def test_jax_reward_of_the_wrong_shape_names_the_reward():
    rewards = RewardSet([JaxReward("scalar", lambda inputs: jnp.float32(1.0))])
    with pytest.raises(ValueError, match=r"JaxReward 'scalar' returned shape \(\), expected"):
        rewards.score(INPUTS)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: RewardSet([]), "at least one reward"),
    (lambda: RewardSet([JaxReward("a", digits_reward), JaxReward("a", digits_reward)]),
     "repeated: a"),
    (lambda: JaxReward("bad name", digits_reward), "got 'bad name'"),
    (lambda: JaxReward("", digits_reward), "got ''"),
    (lambda: PythonReward("a/b", exact), "got 'a/b'"),
    (lambda: JaxReward("mean", digits_reward), "'mean' clashes with the metric reward/mean"),
    (lambda: JaxReward("a", digits_reward, weight=float("nan")), "got nan"),
    (lambda: PythonReward("a", exact, weight=float("inf")), "got inf"),
    (lambda: PythonReward("a", exact, weight="1"), "got '1'"),
    (lambda: PythonReward("a", "not a function"), "fn must be callable"),
    (lambda: RewardSet([PythonReward("exact", exact)]), r"\['exact'\] need a decode"),
    (lambda: RewardSet(["exact"]), "got 'exact'"),
    (lambda: JaxReward("a", digits_reward, bounds=(1, 0)), r"'a': bounds must be .*got \(1, 0\)"),
    (lambda: JaxReward("a", digits_reward, bounds=(0.5, 0.5)), r"low < high, got \(0.5, 0.5\)"),
    (lambda: PythonReward("a", exact, bounds=(0, math.inf)), r"got \(0, inf\)"),
    (lambda: PythonReward("a", exact, bounds=(math.nan, 1)), r"got \(nan, 1\)"),
    (lambda: PythonReward("a", exact, bounds=(0,)), r"got \(0,\)"),
    (lambda: PythonReward("a", exact, bounds=(0, "1")), r"got \(0, '1'\)"),
    (lambda: PythonReward("a", exact, bounds=1.0), "got 1.0"),
])
def test_validation_errors_name_the_bad_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_solved_is_the_highest_total_a_sample_can_earn():
    # max_total = sum of the positive weights: a penalty (negative weight) is best at 0.
    rewards = RewardSet([JaxReward("right", lambda inputs: None, weight=1.0),
                         JaxReward("bonus", lambda inputs: None, weight=0.5),
                         JaxReward("penalty", lambda inputs: None, weight=-0.5)])
    assert rewards.max_total == 1.5
    np.testing.assert_array_equal(rewards.solved(np.array([1.5, 1.0, 0.5, 1.4999999])),
                                  [True, False, False, True])


def test_max_total_takes_each_reward_at_the_best_end_of_its_bounds():
    def unused(inputs):
        return None

    rewards = RewardSet([JaxReward("score", unused, weight=1.0, bounds=(0, 2)),
                         JaxReward("penalty", unused, weight=-0.5, bounds=[-1, 1]),  # -1: +0.5
                         PythonReward("offset", exact, weight=0.5, bounds=(1, 3)),  # 3: +1.5
                         JaxReward("off", unused, weight=0.0, bounds=(-5, 5))], decode=DECODE)
    assert rewards.rewards[1].bounds == (-1.0, 1.0)
    assert rewards.max_total == 4.0
    np.testing.assert_array_equal(rewards.solved(np.array([4.0, 3.5])), [True, False])
