"""The model directory's Hugging Face tokenizer as JetStream's `Tokenizer`.

Text is encoded as `jaxrl generate` encodes a prompt (`jaxrl.data.tokenizer`: the chat
template when asked for and present, else the tokenizer's own special tokens), so a served
completion is the one `jaxrl generate` prints. Prompts are right-padded (JetStream's
convention) to the next prefill bucket (`ServeSection.prefill_buckets`); one longer than the
largest is refused, never cut. JetStream's `is_bos` is ignored: the HF tokenizer places
BOS where its model expects it. The stop tokens are jaxrl's (`EngineSpec.end_token_ids`: the
tokenizer's and the model's EOS ids and `rollout.stop_token_ids`), not JetStream's default
{eos, pad}.
"""

from __future__ import annotations

import bisect

import numpy as np

from jaxrl.data.tokenizer import encode_prompts, load_tokenizer, pad_token_id
from jaxrl.serve.jetstream import tokenizer_api


class PromptTooLong(ValueError):
    """A prompt has more tokens than the server's `serve.max_prefill_length`."""


class HFTokenizer(tokenizer_api.Tokenizer):
    """JetStream's Tokenizer over `load_tokenizer(path)` (module docstring)."""

    def __init__(self, path: str, *, chat_template: bool, stop_ids: tuple[int, ...],
                 buckets: tuple[int, ...]):
        self.hf = load_tokenizer(path)
        self.chat_template = chat_template
        self.stop_ids = frozenset(stop_ids)
        self.buckets = buckets

    def ids(self, text: str) -> list[int]:
        """The prompt's token ids, unpadded."""
        ids_1xP, _ = encode_prompts(self.hf, [text], chat_template=self.chat_template)
        return [int(t) for t in ids_1xP[0]]

    def pad(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """(ids right-padded to their bucket, how many are real); PromptTooLong past the
        largest bucket."""
        if len(ids) > self.buckets[-1]:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens, more than this server's "
                                f"serve.max_prefill_length {self.buckets[-1]}")
        width = self.buckets[bisect.bisect_left(self.buckets, len(ids))]
        padded = np.full((width,), self.pad_id, np.int32)
        padded[:len(ids)] = ids
        return padded, len(ids)

    def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
        return self.pad(self.ids(s))

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self.hf.decode([int(t) for t in token_ids], skip_special_tokens=True)

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.hf)

    @property
    def eos_id(self) -> int:
        return self.hf.eos_token_id if self.hf.eos_token_id is not None else -1

    @property
    def bos_id(self) -> int:
        return self.hf.bos_token_id if self.hf.bos_token_id is not None else -1

    @property
    def stop_tokens(self) -> set[int]:
        return set(self.stop_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)
