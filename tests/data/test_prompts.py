"""Prompt data: fixed-shape left-padded batches, dropped long prompts, seeded epochs, resume."""

import json

import datasets
import numpy as np
import pandas as pd
import pytest

from jaxrl.data.prompts import PromptSource
from jaxrl.data.tokenizer import load_tokenizer, make_char_tokenizer, pad_token_id

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
        assert rows == batches.rows_N[batches.order(epoch)[:9]].tolist()
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
    state = json.loads(json.dumps(batches.state()))
    assert state == {"epoch": 0, "offset": 6}
    expected = [next(batches) for _ in range(5)]  # crosses into epochs 1 and 2
    resumed = source.build(tokenizer)
    resumed.restore(state)
    for want, got in zip(expected, (next(resumed) for _ in range(5)), strict=True):
        assert (want.ids_BxP == got.ids_BxP).all() and (want.rows_B == got.rows_B).all()
    assert resumed.state() == batches.state() == {"epoch": 2, "offset": 3}


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
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt\nabc\n")
    with pytest.raises(ValueError, match=r"unsupported prompt file extension '\.csv'"):
        build(csv)
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
    with pytest.raises(ValueError, match="keys 'epoch' and 'offset'"):
        batches.restore({"epoch": 0})
    with pytest.raises(ValueError, match=r"offset must be a multiple of batch_size=3 from 0 to 6"):
        batches.restore({"epoch": 0, "offset": 9})
