"""How many decode slots a rollout runs with: its slot count, and the tiers of ever fewer
slots its tail moves into (`decode_loop.rollout`, `rollout.engine.min_slots`)."""

from __future__ import annotations

from jaxrl.rollout.settings import EngineConfig


def max_concurrent_decodes(config: EngineConfig, num_rows: int) -> int:
    """The decode slots of a rollout of `num_rows` rows: `max_slots` (None: every row), at
    most the rows, at least 2: with one row XLA's dots take their matrix-vector path, which
    rounds differently (fp32 roundoff in log-probs); from 2 slots up a row's numbers
    do not depend on the slot count, and a spare slot just stays free."""
    return max(2, num_rows if config.max_slots is None else min(config.max_slots, num_rows))


TAIL_TOKENS = 32  # `tail_min_slots`: rows shorter than this leave no tail worth a halving


def tail_min_slots(config: EngineConfig, num_slots: int, max_new_tokens: int) -> int | None:
    """The `min_slots` a rollout of `num_slots` slots and rows up to `max_new_tokens` runs
    with: the config's, or for "auto" down to max(2, S / 32) (at most five halvings, each a
    compiled decode loop) when the batching is continuous and rows may run `TAIL_TOKENS`
    tokens or more; None (no halving) otherwise: short rows leave no tail to halve, and
    each halving costs a compile. Why down to 2 rather than 4: benchmarks/README.md, "Rollout
    engine details"."""
    if config.min_slots != "auto":
        return config.min_slots
    if config.batching != "continuous" or max_new_tokens < TAIL_TOKENS:
        return None
    return max(2, num_slots // 32)


def slot_tiers(num_slots: int, min_slots: int | None) -> tuple[int, ...]:
    """The slot counts the loop runs with: `num_slots`, then halves while >= `min_slots`."""
    tiers = [num_slots]
    while min_slots is not None and tiers[-1] // 2 >= max(min_slots, 2):
        tiers.append(tiers[-1] // 2)
    return tuple(tiers)
