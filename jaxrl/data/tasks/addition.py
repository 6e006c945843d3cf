"""Synthetic addition: the verifiable task the CPU quickstart trains on.

A prompt adds two n-digit numbers, written zero-padded to n digits ("47+85=", "07+05="); the
answer is the sum written with exactly n+1 digits, zero-padded, then EOS ("132<eos>",
"012<eos>"). A completion is checked position by position against the A = n+2 target
tokens t (the n+1 digits and the EOS), with partial credit:

    r = (1/A) · Σ_{a<A} 1[m_a = 1 and c_a = t_a]

c the completion tokens and m their mask. A completion shorter than A (mask 0, or fewer than
A columns) is wrong at the positions it lacks; tokens after position A are ignored, so the
sampler's padding and anything after the answer cost nothing. Exact match is r = 1.

Operands are drawn uniformly from [0, 10^n), not [10^(n-1), 10^n): with zero-padded
operands every prompt has the same 2n+2 characters (no left padding, each digit at a fixed
column) and every operand digit, the leading one included, is uniform over 0-9, so the whole
input space is covered and no digit position is easier than another.

Held-out problems: a fixed tenth of all problems (x, y), chosen by a hash of the pair, is
never drawn for training (`split="train"`) and is what evaluation draws from
(`split="eval"`, distinct problems), so the greedy evaluation measures generalisation, not
memory. With 2 digits that is about 1,000 of the 10,000 problems.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from jaxrl.data.tokenizer import make_char_tokenizer

ADDITION_ALPHABET = "0123456789+="


Split = Literal["train", "eval"]
HELD_OUT_MODULUS = 10  # one problem in 10 is held out for evaluation
_ENUMERABLE = 10**6  # problem spaces up to this size are enumerated for distinct eval draws
_CHUNK = 1024


def held_out(x_N: np.ndarray, y_N: np.ndarray) -> np.ndarray:
    """bool_N: whether problem (x, y) is held out for evaluation (a fixed hash of the pair)."""
    x_N, y_N = np.asarray(x_N).astype(np.uint64), np.asarray(y_N).astype(np.uint64)
    # A multiplicative hash, wrapping modulo 2^64 (numpy's uint64 arithmetic); its high bits mix
    # every digit of both operands.
    h_N = x_N * np.uint64(0x9E3779B97F4A7C15) + y_N * np.uint64(0xBF58476D1CE4E5B9)
    return (h_N >> np.uint64(33)) % np.uint64(HELD_OUT_MODULUS) == 0


def make_addition_tokenizer() -> PreTrainedTokenizerFast:
    """The char-level tokenizer of the task: 4 specials then ADDITION_ALPHABET (16 ids)."""
    return make_char_tokenizer(ADDITION_ALPHABET)


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    """Adding two `num_digits`-digit numbers; answers have num_digits + 1 digits then EOS."""

    num_digits: int = 2

    def __post_init__(self):
        # 18 digits keeps both operands and the sum inside int64.
        if not 1 <= self.num_digits <= 18:
            raise ValueError(f"num_digits must be in [1, 18], got {self.num_digits}")

    @property
    def answer_len(self) -> int:
        """A: answer tokens including the final EOS (num_digits + 2)."""
        return self.num_digits + 2

    def sample_problems(self, n: int, seed: int, split: Split = "train",
                        ) -> list[dict[str, str]]:
        """n problems {"prompt": "47+85=", "answer": "132"} of `split`, the same for the same
        seed (a longer draw extends a shorter one).

        "train" draws uniformly, with repeats, from the problems that are not held out;
        "eval" draws distinct held-out problems, all of them (fewer than n) when there are not
        n (small digit counts).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if split not in typing.get_args(Split):
            raise ValueError(f"split must be one of {typing.get_args(Split)}, got {split!r}")
        d = self.num_digits
        rng = np.random.default_rng(seed)
        if split == "eval" and 10 ** (2 * d) <= _ENUMERABLE:
            x_N, y_N = np.divmod(np.arange(10 ** (2 * d), dtype=np.int64), 10**d)
            held_N = np.flatnonzero(held_out(x_N, y_N))
            pairs = np.stack([x_N, y_N], 1)[rng.permutation(held_N)[:n]]
        else:
            chunks, count = [], 0
            while count < n:  # fixed-size chunks of one stream: prefixes stay the same
                chunk = rng.integers(0, 10**d, size=(_CHUNK, 2), dtype=np.int64)
                keep = held_out(chunk[:, 0], chunk[:, 1]) == (split == "eval")
                chunks.append(chunk[keep])
                count += int(keep.sum())
            pairs = np.concatenate(chunks)[:n]
        return [{"prompt": f"{int(x):0{d}d}+{int(y):0{d}d}=", "answer": f"{int(x + y):0{d + 1}d}"}
                for x, y in pairs]

    def answer_token_ids(self, tokenizer: PreTrainedTokenizerBase,
                         answers: list[str]) -> np.ndarray:
        """target_ids_BxA int32: each answer's digit ids then the EOS id."""
        d = self.num_digits + 1
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token")
        rows = []
        for answer in answers:
            if len(answer) != d or not answer.isdigit():
                raise ValueError(f"answer {answer!r} is not {d} digits")
            ids = tokenizer.encode(answer, add_special_tokens=False)
            if len(ids) != d or tokenizer.unk_token_id in ids:
                raise ValueError(f"answer {answer!r} is not one known token per digit: {ids}")
            rows.append([*ids, tokenizer.eos_token_id])
        return np.asarray(rows, np.int32).reshape(len(answers), self.answer_len)

    def chance_reward(self, vocab_size: int) -> float:
        """E[r] of a policy uniform over `vocab_size` tokens that stops at its first EOS.

        Position a scores when the token drawn there is t_a (probability 1/V) and no EOS was
        drawn before it ((1 - 1/V)^a: the target digits are not EOS, so an earlier hit never
        ends the row). Summing the geometric series,

            E[r] = (1/A) · Σ_{a<A} (1/V)(1 - 1/V)^a = (1 - (1 - 1/V)^A) / A,

        about 1/V for large V. Assumes a budget of at least A new tokens.
        """
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        a = self.answer_len
        return (1.0 - (1.0 - 1.0 / vocab_size) ** a) / a


def _correct_BxA(completion_ids_BxC: jax.Array, completion_mask_BxC: jax.Array,
                 target_ids_BxA: jax.Array) -> jax.Array:
    """1[m_a and c_a = t_a] per target position; columns the completion lacks are wrong."""
    a, c = target_ids_BxA.shape[1], completion_ids_BxC.shape[1]
    ids_BxA = completion_ids_BxC[:, :a]
    mask_BxA = completion_mask_BxC[:, :a].astype(bool)
    if c < a:
        ids_BxA = jnp.pad(ids_BxA, ((0, 0), (0, a - c)))
        mask_BxA = jnp.pad(mask_BxA, ((0, 0), (0, a - c)))
    return mask_BxA & (ids_BxA == target_ids_BxA)


def addition_reward(completion_ids_BxC: jax.Array, completion_mask_BxC: jax.Array,
                    target_ids_BxA: jax.Array) -> jax.Array:
    """r_B = (1/A) Σ_a 1[m_a and c_a = t_a] in [0, 1], float32 (module docstring)."""
    return _correct_BxA(completion_ids_BxC, completion_mask_BxC,
                        target_ids_BxA).astype(jnp.float32).mean(axis=1)


def exact_match(completion_ids_BxC: jax.Array, completion_mask_BxC: jax.Array,
                target_ids_BxA: jax.Array) -> jax.Array:
    """bool_B: all A target positions (digits and EOS) right, i.e. r = 1."""
    return _correct_BxA(completion_ids_BxC, completion_mask_BxC, target_ids_BxA).all(axis=1)
