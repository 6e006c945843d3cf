"""Tokenizer glue: a saved tokenizer loads back, prompts are left-padded, completions decode."""

import numpy as np
import pytest

from jaxrl.data.tokenizer import (
    decode_completions,
    encode_prompts,
    load_tokenizer,
    make_char_tokenizer,
    pad_token_id,
)

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"


@pytest.fixture
def tokenizer(tmp_path):
    make_char_tokenizer(ALPHABET).save_pretrained(tmp_path)
    return load_tokenizer(tmp_path)


def test_saved_tokenizer_round_trips_text(tokenizer):
    ids = tokenizer.encode("what is 12+30?")
    assert len(ids) == len("what is 12+30?")
    assert tokenizer.decode(ids) == "what is 12+30?"
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_prompts_are_left_padded_to_the_longest(tokenizer):
    ids_BxP, mask_BxP = encode_prompts(tokenizer, ["abc", "a", "hello there"])
    assert ids_BxP.shape == mask_BxP.shape == (3, 11)
    assert mask_BxP.sum(axis=1).tolist() == [3, 1, 11]
    # Real tokens end at the last column; padding is on the left and uses the pad id.
    assert mask_BxP[:, -1].all()
    assert (ids_BxP[~mask_BxP] == pad_token_id(tokenizer)).all()
    assert tokenizer.decode(ids_BxP[0][mask_BxP[0]]) == "abc"


def test_chat_template_is_applied_when_present(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}q={{ m['content'] }}{% endfor %}="
    ids_BxP, mask_BxP = encode_prompts(tokenizer, ["1+1"])
    assert tokenizer.decode(ids_BxP[0][mask_BxP[0]]) == "q=1+1="
    plain, _ = encode_prompts(tokenizer, ["1+1"], chat_template=False)
    assert tokenizer.decode(plain[0]) == "1+1"


def test_decode_drops_masked_and_special_tokens(tokenizer):
    ids = np.array([[4, 5, 2, 0], [6, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    assert decode_completions(tokenizer, ids, mask) == ["ab", "c"]


def test_bad_input_is_named(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="model directory .*missing' does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="no prompts"):
        encode_prompts(tokenizer, [])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        encode_prompts(tokenizer, [""], chat_template=False)


def test_a_corrupted_tokenizer_file_is_named(tmp_path, tokenizer):
    from jaxrl.models.hf_io import CheckpointError

    tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    with pytest.raises(CheckpointError, match=f"the tokenizer in {str(tmp_path)!r} cannot be "
                                              f"loaded"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_generic_tokenizer_in_a_model_directory_loads_as_saved(tmp_path, model_type):
    # transformers' AutoTokenizer would pick the model type's tokenizer class from config.json
    # and re-tokenize (a Qwen2 tokenizer drops the spaces of this character tokenizer).
    from flax import nnx

    from jaxrl.models import Transformer, save_pretrained
    from jaxrl.models.config import tiny_config

    original = make_char_tokenizer(ALPHABET)
    save_pretrained(Transformer(tiny_config(model_type, vocab_size=len(original)),
                                rngs=nnx.Rngs(0)), tmp_path)
    original.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "what is 12 + 30 ?"
    assert loaded.encode(text) == original.encode(text)
    assert len(loaded.encode(text)) == len(text) and loaded.decode(loaded.encode(text)) == text


def test_extra_tokens_are_matched_whole_and_kept_by_decoding(tmp_path):
    tok = make_char_tokenizer("0123456789*", extra_tokens=("<call>", "</call>"))
    text = "12*3<call>12*3</call>36"
    ids = tok.encode(text, add_special_tokens=False)
    call, end = tok.convert_tokens_to_ids(["<call>", "</call>"])
    assert ids == [*tok.encode("12*3", add_special_tokens=False), call,
                   *tok.encode("12*3", add_special_tokens=False), end,
                   *tok.encode("36", add_special_tokens=False)]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).encode(text, add_special_tokens=False) == ids


def test_tools_are_handed_to_the_chat_template(tokenizer):
    tokenizer.chat_template = ("{% if tools %}tools {% for t in tools %}{{ t['function']['name'] }}"
                               " {% endfor %}{% endif %}{% for m in messages %}"
                               "{{ m['content'] }}{% endfor %}")
    schema = {"type": "function", "function": {"name": "calculator", "description": "d",
                                               "parameters": {"type": "object"}}}
    with_tools, _ = encode_prompts(tokenizer, ["7+8="], tools=[schema])
    plain, _ = encode_prompts(tokenizer, ["7+8="])
    assert tokenizer.decode(with_tools[0]) == "tools calculator 7+8="
    assert tokenizer.decode(plain[0]) == "7+8="
