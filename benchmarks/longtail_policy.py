"""A Qwen2 whose completions end at EOS with long-tailed lengths: `vs_trl.py --workload longtail`.

The lengths must be a property of the weights, not of either library's sampler, the same
from step to step and from run to run. So the policy is built to be a Markov chain over
three classes of tokens, while remaining a full Qwen2 that does all of its FLOPs:

- every decoder layer's output projections (`o_proj`, `down_proj`) are zero: attention and
  the MLP run on every token as usual, but add nothing to the residual stream, which thus
  holds the current token's input embedding from the first layer to the final norm (exactly:
  Qwen2's o_proj and down_proj have no bias). Small non-zero weights would leave the chain
  exact only approximately, and the approximation would depend on the context (and on the
  library's rounding), so they are zero;
- the input embedding of a token of class c is sqrt(hidden) * e_c (e_c a unit vector of the
  hidden space, one per class: a residual of RMS 1, like a trained model's), so the final
  RMSNorm (weight 1) leaves it as it is;
- the lm_head is untied (`tie_word_embeddings=False`; a tied head would make the transition
  logits a symmetric form of the embeddings) and row t holds log p(t | c) / sqrt(hidden) in
  column c: the logits of a class-c token are log p(. | c) (up to a constant).

The classes: A and B are two halves of the tokenizer's filler words (`w123`), P is every other
token (prompt words, template words, specials). Next-token distributions:

    P -> A w.p. CAP_FRACTION (uniform over A), B w.p. 1 - CAP_FRACTION (uniform over B)
    A -> A (uniform): a row that enters A never emits EOS and runs to the cap
    B -> EOS w.p. q, else B (uniform)

and every other next token a logit GAP nats below the least likely allowed one (a probability
below 1e-21). A completion's length L counts its EOS (as both libraries' masks do): a B row has one B token,
then K - 1 more and the EOS with K ~ Geometric(q), so L = 1 + K and P(L <= l | B) =
1 - (1 - q)^(l - 1). Over all rows P(L <= l) = (1 - CAP_FRACTION) P(L <= l | B) (below the
cap), so the median is MEDIAN when (1 - q)^(MEDIAN - 1) = 1 - 0.5 / (1 - CAP_FRACTION) (= 1/3:
the median of all rows is the 2/3 quantile of the B rows): q = 0.0562 for MEDIAN 20. Mean
length: CAP_FRACTION * CAP + (1 - CAP_FRACTION) * (1 + 1/q) = 78.1 for a cap of 256; a B row
reaches the cap with probability (1 - q)^(CAP - 2) ~ 4e-7.

A and B are filler words, which never form "\\boxed{...}" or "####", so `math_reward` is 0 on
every completion: every group's rewards are equal, every advantage is 0, the policy loss has a
zero gradient and AdamW (zero moments, no weight decay) leaves the weights exactly as they
were. The distribution is the same at every measured step, and in both libraries.

For jaxrl's per-row lengths (its bench reports only means), `math_reward` here is the task's
reward unchanged, which also appends each completion's length to the file named by
$LONGTAIL_LENGTHS (jaxrl runs it as `data.reward_fn`; TRL's reward sees completion_ids). A
completion's text is its filler words joined by spaces (EOS is dropped as a special token), so
its length is the word count plus the EOS, unless it ran to the cap.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Sequence

CAP = 256  # rollout.max_new_tokens / TRL max_completion_length
CAP_FRACTION = 0.25  # rows that enter class A and run to the cap
MEDIAN = 20  # the median completion length over all rows, EOS counted
EOS_PROB = 1 - (1 - 0.5 / (1 - CAP_FRACTION)) ** (1 / (MEDIAN - 1))  # q, per B token
GAP = 40.0  # nats below the allowed next tokens' logits for every other token
LENGTHS_ENV = "LONGTAIL_LENGTHS"
_FILLER = re.compile(r"w\d+")


def token_classes(tokenizer) -> tuple[list[int], list[int]]:
    """(A ids, B ids): the first and second half of the filler words, by id."""
    fillers = sorted(i for t, i in tokenizer.get_vocab().items() if _FILLER.fullmatch(t))
    half = len(fillers) // 2
    return fillers[:half], fillers[half:]


def transition_logits(vocab: int, eos: int, a_ids: Sequence[int], b_ids: Sequence[int]):
    """[3, vocab] float64 torch tensor: log p(next | class) for classes P, A, B (docstring)."""
    import torch

    floor = math.log(min(CAP_FRACTION / len(a_ids), (1 - CAP_FRACTION) / len(b_ids),
                         EOS_PROB, (1 - EOS_PROB) / len(b_ids))) - GAP
    logits = torch.full((3, vocab), floor, dtype=torch.float64)
    a, b = torch.tensor(list(a_ids)), torch.tensor(list(b_ids))
    logits[0, a] = math.log(CAP_FRACTION / len(a_ids))
    logits[0, b] = math.log((1 - CAP_FRACTION) / len(b_ids))
    logits[1, a] = math.log(1 / len(a_ids))
    logits[2, b] = math.log((1 - EOS_PROB) / len(b_ids))
    logits[2, eos] = math.log(EOS_PROB)
    return logits


def make_markov(model, tokenizer) -> None:
    """Overwrites an untied `Qwen2ForCausalLM`'s weights in place so that it samples the
    chain of the module docstring (every other weight keeps its initialisation)."""
    import torch

    config = model.config
    if config.tie_word_embeddings:
        raise ValueError("the long-tail policy needs tie_word_embeddings=False")
    vocab, hidden = config.vocab_size, config.hidden_size
    a_ids, b_ids = token_classes(tokenizer)
    cls = torch.zeros(vocab, dtype=torch.long)  # class P
    cls[a_ids], cls[b_ids] = 1, 2
    scale = math.sqrt(hidden)  # RMSNorm(scale * e_c) = scale * e_c (up to its eps)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros(vocab, hidden, dtype=torch.float64)
        embed[torch.arange(vocab), cls] = scale
        head = torch.zeros(vocab, hidden, dtype=torch.float64)
        head[:, :3] = transition_logits(vocab, tokenizer.eos_token_id, a_ids, b_ids).T
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head / math.sqrt(hidden))
        model.model.norm.weight.fill_(1.0)


def length_from_text(completion: str) -> int:
    """A completion's length in tokens, EOS counted, from its text (module docstring)."""
    words = len(completion.split())
    return words if words >= CAP else words + 1


def math_reward(prompt: str, completion: str, fields: dict) -> float:
    """gsm8k's `math_reward`; appends the completion's length to $LONGTAIL_LENGTHS."""
    from jaxrl.data.tasks.gsm8k import math_reward as reward

    with open(os.environ[LENGTHS_ENV], "a", encoding="utf-8") as f:
        f.write(f"{length_from_text(completion)}\n")
    return reward(prompt, completion, fields)


def length_stats(lengths: Sequence[int]) -> dict:
    """median, mean, fraction at the cap, min and max of completion lengths."""
    return {"rows": len(lengths), "len_median": statistics.median(lengths),
            "len_mean": statistics.fmean(lengths),
            "cap_frac": sum(n >= CAP for n in lengths) / len(lengths),
            "len_min": min(lengths), "len_max": max(lengths)}


def expected_stats() -> dict:
    """The chain's own median, mean and cap fraction (module docstring)."""
    q, b = EOS_PROB, 1 - CAP_FRACTION
    mean_b = sum(min(1 + k, CAP) * q * (1 - q) ** (k - 1) for k in range(1, CAP)) \
        + CAP * (1 - q) ** (CAP - 1)
    return {"len_median": MEDIAN, "len_mean": CAP_FRACTION * CAP + b * mean_b,
            "cap_frac": CAP_FRACTION + b * (1 - q) ** (CAP - 2), "eos_prob": q}
