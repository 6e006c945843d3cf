"""Tokenizer glue: load from a model directory, left-pad prompts, decode completions.

Prompts are rendered with the tokenizer's chat template when it has one (a single user
turn plus the generation prompt) and left-padded, so every prompt ends at the same column
and the sampler's prefill ends on each prompt's last real token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from jaxrl.models.hf_io import CheckpointError

# What transformers writes as tokenizer_class for a tokenizer built from a `tokenizers` object.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer saved in a model directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} "
                                f"{'is a file' if path.exists() else 'does not exist'}; expected "
                                f"a folder with config.json, *.safetensors and tokenizer files")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer in {str(path)!r}: expected tokenizer.json or tokenizer_config.json "
            "(save one with tokenizer.save_pretrained)")
    # AutoTokenizer prefers the class of config.json's model type (Qwen2Tokenizer next to a
    # qwen2 config), which re-builds a generic tokenizer differently (it drops the spaces of a
    # character tokenizer): a tokenizer saved as the generic class loads as that class.
    config_file = path / "tokenizer_config.json"
    try:
        saved = None
        if config_file.is_file():
            saved = json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
        if saved in _GENERIC_CLASSES:
            tokenizer_class = PreTrainedTokenizerFast
        else:
            # Imported here: AutoTokenizer's module imports transformers' model configuration,
            # which imports torch whenever it is installed (seconds of every command's start).
            from transformers import AutoTokenizer as tokenizer_class
        return tokenizer_class.from_pretrained(str(path))
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
        # A corrupted tokenizer.json raises the tokenizers library's Exception (a ValueError
        # subclass on current versions); a missing vocab file an OSError.
        raise CheckpointError(f"the tokenizer in {str(path)!r} cannot be loaded: "
                         f"{type(e).__name__}: {str(e)[:300]}") from None


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The pad id, else the EOS id (padding is masked anyway), else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def render_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool,
                  tools: Sequence[dict[str, Any]] | None = None) -> str:
    """One user turn through the chat template (when asked for and present), else the text.
    `tools` (function schemas) go to the template, which describes them the way the model
    was trained to read (a multi-turn run's tools, `jaxrl.envs.tools.tool_schema`)."""
    if chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tools=list(tools) if tools else None,
                                             add_generation_prompt=True, tokenize=False)
    return text


def encode_prompts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *,
                   chat_template: bool = True, tools: Sequence[dict[str, Any]] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(ids_BxP int32, mask_BxP bool), left-padded to the longest prompt."""
    if not texts:
        raise ValueError("no prompts given")
    rendered = [render_prompt(tokenizer, t, chat_template, tools) for t in texts]
    # A chat template already places BOS and friends; plain text gets the usual specials.
    add_special = not (chat_template and tokenizer.chat_template)
    # One batch call: a fast tokenizer encodes the batch in Rust, faster than one `encode` at
    # a time, with the same ids (benchmarks/README.md, "Host-side setup costs").
    encoded = tokenizer(rendered, add_special_tokens=add_special)["input_ids"]
    for text, ids in zip(texts, encoded, strict=True):
        if not ids:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
    length = max(len(ids) for ids in encoded)
    ids_BxP = np.full((len(encoded), length), pad_token_id(tokenizer), np.int32)
    mask_BxP = np.zeros((len(encoded), length), bool)
    for row, ids in enumerate(encoded):
        ids_BxP[row, length - len(ids):] = ids
        mask_BxP[row, length - len(ids):] = True
    return ids_BxP, mask_BxP


def decode_completions(tokenizer: PreTrainedTokenizerBase, ids_BxC: np.ndarray,
                       mask_BxC: np.ndarray) -> list[str]:
    """Completion texts (masked tokens dropped, special tokens kept out)."""
    return [tokenizer.decode([int(t) for t, m in zip(ids, mask, strict=True) if m],
                             skip_special_tokens=True)
            for ids, mask in zip(np.asarray(ids_BxC), np.asarray(mask_BxC), strict=True)]


def completion_end_ids(tokenizer: PreTrainedTokenizerBase, model_config: Any,
                       extra: Sequence[int]) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model config, plus the configured ones."""
    ids = set(extra)
    for source in (tokenizer.eos_token_id, model_config.eos_token_id):
        if source is None:
            continue
        ids.update(source if isinstance(source, (tuple, list)) else [source])
    return tuple(sorted(int(i) for i in ids))


def rollout_end_ids(tokenizer: PreTrainedTokenizerBase, model_config: Any,
                    rollout: Any) -> tuple[int, ...]:
    """The ids that end a rollout's completion: `completion_end_ids` with
    `rollout.stop_token_ids`, none at all with `rollout.ignore_eos`."""
    if rollout.ignore_eos:
        return ()
    return completion_end_ids(tokenizer, model_config, rollout.stop_token_ids)


def make_char_tokenizer(alphabet: str, *, extra_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with <pad>=0, <bos>=1, <eos>=2, for tiny demo/test models.

    Every character of `alphabet` is one token; ids follow the specials and `extra_tokens`.
    Each extra token (a tool-call tag like "<call>") is matched whole in text, before the
    split into characters, and kept by decoding (it is not a special token).
    Saved with `save_pretrained`, it loads back through `load_tokenizer` like any HF one.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", *extra_tokens]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")
