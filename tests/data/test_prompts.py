"""Prompt data: fixed-shape left-padded batches, dropped long prompts, seeded epochs, resume."""

import json

import datasets
import numpy as np
import pandas as pd
import pytest

from jaxrl.data.curriculum import make_prompt_sampler
from jaxrl.data.prompts import PromptBatches, PromptSource, PromptStats
from jaxrl.data.tokenizer import load_tokenizer, make_char_tokenizer, pad_token_id
from tests.data.test_curriculum import np_round_trip

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"
PROMPTS = ["1+1", "22+3", "a", "what is 7", "9+9=?", "hi", "abcdef", "x y", "12", "5+55"]
ROWS = [{"prompt": p, "answer": str(i), "level": i % 3} for i, p in enumerate(PROMPTS)]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    # load_dataset caches the arrow files it makes; keep them out of the user's cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


@pytest.fixture
def tokenizer(tmp_path):
    make_char_tokenizer(ALPHABET).save_pretrained(tmp_path / "tok")
    return load_tokenizer(tmp_path / "tok")


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def rows_of(batches, n):
    return [next(batches).rows_B.tolist() for _ in range(n)]


def test_batches_are_fixed_shape_left_padded_and_carry_fields(tokenizer, jsonl):
    source = PromptSource(jsonl, field_columns=("answer", "level"), max_prompt_len=12,
                          batch_size=4, chat_template=False)
    batches = source.build(tokenizer)
    for _ in range(3):
        batch = next(batches)
        assert batch.ids_BxP.shape == batch.mask_BxP.shape == (4, 12)
        assert batch.ids_BxP.dtype == np.int32 and batch.mask_BxP.dtype == bool
        # Every prompt ends at the last column; padding is on the left, with the pad id.
        assert batch.mask_BxP[:, -1].all()
        assert (np.diff(batch.mask_BxP.astype(int), axis=1) >= 0).all()
        assert (batch.ids_BxP[~batch.mask_BxP] == pad_token_id(tokenizer)).all()
        for row, ids, mask, answer, level in zip(batch.rows_B, batch.ids_BxP, batch.mask_BxP,
                                                 batch.fields["answer"], batch.fields["level"],
                                                 strict=True):
            assert tokenizer.decode(ids[mask]) == PROMPTS[row]
            assert (answer, level) == (str(row), row % 3)


def test_long_prompts_are_dropped_and_counted_never_truncated(tokenizer, tmp_path):
    path = tmp_path / "prompts.parquet"
    pd.DataFrame(ROWS).to_parquet(path)
    batches = PromptSource(path, max_prompt_len=4, batch_size=2, chat_template=False).build(
        tokenizer)
    fits = {i for i, p in enumerate(PROMPTS) if len(p) <= 4}
    assert batches.stats.num_rows == 10
    assert batches.stats.num_prompts == len(fits) == 7
    assert batches.stats.num_dropped == 3
    assert batches.stats.longest == 4  # "22+3" and "5+55" fit exactly
    seen = {r for rows in rows_of(batches, 20) for r in rows}
    assert seen == fits


def test_every_usable_prompt_appears_once_per_epoch_and_epochs_reshuffle(tokenizer, jsonl):
    # 10 prompts, 3 per batch: 3 batches per epoch, 1 prompt of each epoch's order left out.
    batches = PromptSource(jsonl, batch_size=3, seed=7).build(tokenizer)
    assert batches.batches_per_epoch == 3
    epochs = [sum(rows_of(batches, 3), []) for _ in range(4)]
    left_out = []
    for epoch, rows in enumerate(epochs):
        assert len(set(rows)) == 9
        # Bit-identical to the permutation drawn from (seed, epoch), as before curricula.
        order_N = np.random.default_rng((7, epoch)).permutation(10)
        assert rows == batches.rows_N[order_N[:9]].tolist()
        left_out.append(set(range(10)) - set(rows))
    assert len({tuple(rows) for rows in epochs}) == 4
    assert len(set().union(*left_out)) > 1  # the remainder moves with the shuffle


def test_order_is_reproducible_for_a_seed_and_differs_between_seeds(tokenizer, jsonl):
    def first_batches(seed):
        return rows_of(PromptSource(jsonl, batch_size=3, seed=seed).build(tokenizer), 6)

    assert first_batches(0) == first_batches(0)
    assert first_batches(0) != first_batches(1)


def test_state_restore_resumes_mid_epoch_exactly(tokenizer, jsonl):
    source = PromptSource(jsonl, batch_size=3, seed=3)
    batches = source.build(tokenizer)
    rows_of(batches, 2)
    state = np_round_trip(batches.state())
    assert (int(state["epoch"]), int(state["offset"])) == (0, 6)
    expected = [next(batches) for _ in range(5)]  # crosses into epochs 1 and 2
    resumed = source.build(tokenizer)
    resumed.restore(state)
    for want, got in zip(expected, (next(resumed) for _ in range(5)), strict=True):
        assert (want.ids_BxP == got.ids_BxP).all() and (want.rows_B == got.rows_B).all()
    for key in ("epoch", "offset"):
        assert resumed.state()[key] == batches.state()[key] == {"epoch": 2, "offset": 3}[key]


def test_in_memory_dataset_source(tokenizer):
    rows = datasets.Dataset.from_list(ROWS)
    batches = PromptSource(rows, field_columns=["answer"], batch_size=5).build(tokenizer)
    batch = next(batches)
    assert batch.ids_BxP.shape == (5, 256)
    assert batch.fields["answer"] == [str(r) for r in batch.rows_B]


def test_chat_template_is_applied_when_asked(tokenizer, jsonl):
    tokenizer.chat_template = "{% for m in messages %}q={{ m['content'] }}{% endfor %}="
    texts = {}
    for chat in (True, False):
        batch = next(PromptSource(jsonl, chat_template=chat, batch_size=10).build(tokenizer))
        texts[chat] = {int(r): tokenizer.decode(ids[m]) for r, ids, m in
                       zip(batch.rows_B, batch.ids_BxP, batch.mask_BxP, strict=True)}
    assert texts[True][0] == "q=1+1=" and texts[False][0] == "1+1"
    # The limit counts the template's tokens too: "q=" + "1+1" + "=" is 6.
    only_short = PromptSource(jsonl, chat_template=True, max_prompt_len=6, batch_size=1)
    assert only_short.build(tokenizer).stats.longest == 6


def test_bad_input_is_named(tokenizer, jsonl, tmp_path):
    def build(source, **kw):
        return PromptSource(source, **kw).build(tokenizer)

    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        build(tmp_path / "nope.jsonl")
    txt = tmp_path / "prompts.txt"
    txt.write_text("prompt\nabc\n")
    with pytest.raises(ValueError, match=r"unsupported prompt file extension '\.txt'"):
        build(txt)
    with pytest.raises(ValueError, match=r"prompt column 'question' .*\['prompt', 'answer', "):
        build(jsonl, prompt_column="question")
    with pytest.raises(ValueError, match=r"field column 'solution' .*\['prompt', 'answer', "):
        build(jsonl, field_columns=("solution",))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no rows"):
        build(empty)
    with pytest.raises(ValueError, match="no rows"):
        build(datasets.Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="max_prompt_len must be at least 1, got 0"):
        PromptSource(jsonl, max_prompt_len=0)
    with pytest.raises(ValueError, match=r"all 2 prompts .*max_prompt_len=3 .*longest has 7"):
        build(datasets.Dataset.from_dict({"prompt": ["abcd", "abcdefg"]}), max_prompt_len=3)
    with pytest.raises(ValueError, match=r"batch_size=8 .* 5 usable prompts \(5 of 10 dropped"):
        build(jsonl, max_prompt_len=3, chat_template=False)
    with pytest.raises(TypeError, match="not the string 'answer'"):
        PromptSource(jsonl, field_columns="answer")


def test_restore_rejects_a_foreign_state(tokenizer, jsonl):
    batches = PromptSource(jsonl, batch_size=3).build(tokenizer)
    state = batches.state()
    with pytest.raises(ValueError, match="state is missing key 'offset'"):
        batches.restore({k: v for k, v in state.items() if k != "offset"})
    with pytest.raises(ValueError, match=r"offset must be a multiple of batch_size=3 from 0 to 6"):
        batches.restore(state | {"offset": np.asarray(9)})
    with pytest.raises(ValueError, match="has batch_size=4 but this iterator has batch_size=3"):
        batches.restore(state | {"batch_size": np.asarray(4)})


def synthetic_batches(num_prompts=12, batch_size=4, **kw):
    """PromptBatches over made-up token rows: prompt k is [k, k] at dataset row 100 + k."""
    ids_NxP = np.repeat(np.arange(num_prompts, dtype=np.int32)[:, None], 2, axis=1)
    stats = PromptStats(num_rows=num_prompts, num_prompts=num_prompts, num_dropped=0, longest=2)
    return PromptBatches(ids_NxP, np.ones_like(ids_NxP, bool), np.arange(num_prompts) + 100,
                         {"k": list(range(num_prompts))}, batch_size=batch_size, seed=5,
                         stats=stats, **kw)


def test_positions_index_the_usable_prompts_and_feed_observe():
    batches = synthetic_batches()
    batches.use_sampler(make_prompt_sampler("pass_rate", 12, 4, seed=5, group_size=4))
    for step in range(6):
        assert batches.step == step
        batch = next(batches)
        assert batch.positions_B.dtype == np.int64
        assert (batch.ids_BxP[:, 0] == batch.positions_B).all()
        assert (batch.rows_B == batch.positions_B + 100).all()
        assert batch.fields["k"] == batch.positions_B.tolist()
        batches.observe(step, batch.positions_B, np.full(4, 0.5))
    assert batches.metrics()["curriculum/mean_pass_rate"] == 0.5


@pytest.mark.parametrize("kind", ["none", "pass_rate"])
def test_processes_take_contiguous_slices_of_the_same_global_batch(kind):
    success_SxB = np.random.default_rng(0).integers(0, 2, (8, 4)).astype(float)

    def drawn(process_index=0, process_count=1, global_positions=None):
        batches = synthetic_batches(process_index=process_index, process_count=process_count)
        batches.use_sampler(make_prompt_sampler(kind, 12, 4, seed=5, group_size=2))
        out = []
        for step in range(8):
            out.append(next(batches))
            # Every process observes the global batch (gathered from all processes).
            positions_B = out[-1].positions_B if global_positions is None else (
                global_positions[step])
            batches.observe(step, positions_B, success_SxB[step])
        return out

    single = [batch.positions_B for batch in drawn()]
    halves = [drawn(i, 2, single) for i in range(2)]
    for step, (first, second) in enumerate(zip(*halves, strict=True)):
        assert first.ids_BxP.shape == second.ids_BxP.shape == (2, 2)
        assert np.concatenate([first.positions_B, second.positions_B]).tolist() == \
            single[step].tolist()
        assert first.fields["k"] + second.fields["k"] == single[step].tolist()


def test_use_rows_takes_those_rows_of_every_batch_and_reports_the_whole_batch():
    whole, part = synthetic_batches(), synthetic_batches()
    part.use_rows(np.array([0, 3]))
    for _ in range(3):
        a, b = next(whole), next(part)
        assert b.positions_B.tolist() == a.positions_B[[0, 3]].tolist()
        assert b.ids_BxP.shape == (2, 2) and b.fields["k"] == b.positions_B.tolist()
        assert b.all_positions_B.tolist() == a.positions_B.tolist() == a.all_positions_B.tolist()
    for bad in ([], [3, 0], [0, 4], [1.0]):
        with pytest.raises(ValueError, match="rows must be ascending row indices of a batch of 4"):
            part.use_rows(np.array(bad))


def test_sampler_and_process_errors_are_named():
    with pytest.raises(ValueError, match="batch_size=4 must be divisible by process_count=3"):
        synthetic_batches(process_count=3)
    with pytest.raises(ValueError, match="process_index=2 must be in 0..process_count-1"):
        synthetic_batches(process_index=2, process_count=2)
    with pytest.raises(ValueError, match="sampler is for 12 prompts in batches of 6"):
        synthetic_batches(sampler=make_prompt_sampler("none", 12, 6, seed=5))
    batches = synthetic_batches()
    next(batches)
    with pytest.raises(ValueError, match="use_sampler after 1 batches were drawn"):
        batches.use_sampler(make_prompt_sampler("none", 12, 4, seed=5))
