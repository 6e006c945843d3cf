"""What a multi-turn rollout returns (`MultiTurnRollout`), and the host's record of each row
while it runs (`Row`), assembled into it at the end (`assemble`).

A row's record is its completion so far, token by token (model tokens with their log-probs,
observation tokens with 0), the completion columns where its turns start and end, its
environment's last reward and its tools' counts.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxrl.rollout.types import Rollout


@dataclasses.dataclass(frozen=True)
class MultiTurnRollout:
    """B rows of a multi-turn rollout (host numpy arrays besides `rollout`).

    rollout: the `Rollout` the trainer takes: completion_ids_BxC (C = max_total_tokens) =
      turn 1 | obs 1 | turn 2 | ..., completion_mask_BxC 1 on every real token (model and
      observation: the trainer attends over both), logp_BxC / logp_raw_BxC the sampler's
      log-probs (as sampled / at temperature 1) on model tokens, 0 elsewhere; num_steps the
      longest completion; decode_slot_steps the slots x decode steps run.
    observation_mask_BxC: 1 on observation tokens (the loss mask is
      completion_mask & ~observation_mask).
    turn_starts_BxK, turn_ends_BxK (K = max_turns): completion columns [start, end) of each
      turn's model tokens, -1 past num_turns_B; observation k fills [end_k, start_{k+1}),
      a final (cut) one [end_k, its length).
    reward_B: the environment's last reward, NaN where it gave none. truncated_B: the
      episode ended by max_turns or the token budget, not by the environment or EOS.
    tool_calls_B, tool_errors_B, tool_timeouts_B, tool_latency_s_B: `ToolStats` summed.
    vocab_errors_B: observations refused for token ids outside the model's vocabulary (the
      episode ends there, truncated); vocab_error: the first one's message, None when none.
    env_time_s: seconds in `env.step` summed over calls; env_wait_s: host seconds with no
      slot to decode because every busy slot waited on its environment; decode_steps: the
      decode steps run; wall_s: the whole call.
    """

    rollout: Rollout
    observation_mask_BxC: np.ndarray
    turn_starts_BxK: np.ndarray
    turn_ends_BxK: np.ndarray
    num_turns_B: np.ndarray
    reward_B: np.ndarray
    truncated_B: np.ndarray
    tool_calls_B: np.ndarray
    tool_errors_B: np.ndarray
    tool_timeouts_B: np.ndarray
    tool_latency_s_B: np.ndarray
    vocab_errors_B: np.ndarray
    vocab_error: str | None
    env_time_s: float
    env_wait_s: float
    decode_steps: int
    wall_s: float

    @property
    def loss_mask_BxC(self) -> np.ndarray:
        """The policy's own tokens: completion_mask & ~observation_mask."""
        return np.asarray(self.rollout.completion_mask_BxC) & ~self.observation_mask_BxC



class Row:
    """One sample's host record while it runs."""

    def __init__(self):
        self.ids: list[int] = []
        self.is_obs: list[bool] = []
        self.logp: list[float] = []
        self.logp_raw: list[float] = []
        self.starts: list[int] = [0]
        self.ends: list[int] = []
        self.reward = float("nan")
        self.tools = np.zeros(4)  # calls, errors, timeouts, latency_s
        self.truncated = False
        self.eos = False
        self.vocab_error: str | None = None  # an observation refused: ids past the vocabulary

    def add(self, token, is_obs, logp=0.0, logp_raw=0.0):
        self.ids.append(int(token))
        self.is_obs.append(is_obs)
        self.logp.append(float(logp))
        self.logp_raw.append(float(logp_raw))


def assemble(rows: list[Row], ids_BxP, mask_BxP, config, env_time: float, env_wait: float,
             decode_steps: int, wall_s: float) -> MultiTurnRollout:
    """The rows' host records as the `MultiTurnRollout` (`config`: the `MultiTurnConfig`)."""
    b, c, k = len(rows), config.max_total_tokens, config.max_turns
    ids = np.full((b, c), config.pad_token_id, np.int32)
    mask, obs_mask = np.zeros((b, c), bool), np.zeros((b, c), bool)
    logp, logp_raw = np.zeros((b, c), np.float32), np.zeros((b, c), np.float32)
    starts, ends = np.full((b, k), -1, np.int32), np.full((b, k), -1, np.int32)
    for r, row in enumerate(rows):
        n = len(row.ids)
        ids[r, :n], mask[r, :n], obs_mask[r, :n] = row.ids, True, row.is_obs
        logp[r, :n], logp_raw[r, :n] = row.logp, row.logp_raw
        starts[r, :len(row.ends)] = row.starts[:len(row.ends)]
        ends[r, :len(row.ends)] = row.ends
    tools = np.stack([row.tools for row in rows]) if rows else np.zeros((0, 4))
    lengths = mask.sum(axis=1)
    rollout = Rollout(
        prompt_ids_BxP=jnp.asarray(ids_BxP), prompt_mask_BxP=jnp.asarray(mask_BxP),
        completion_ids_BxC=jnp.asarray(ids), completion_mask_BxC=jnp.asarray(mask),
        logp_BxC=jnp.asarray(logp), logp_raw_BxC=jnp.asarray(logp_raw),
        num_steps=jnp.asarray(int(lengths.max(initial=0)), jnp.int32),
        decode_slot_steps=jnp.asarray(decode_steps * config.num_slots, jnp.int32))
    return MultiTurnRollout(
        rollout=rollout, observation_mask_BxC=obs_mask, turn_starts_BxK=starts,
        turn_ends_BxK=ends, num_turns_B=np.array([len(r.ends) for r in rows], np.int32),
        reward_B=np.array([r.reward for r in rows], np.float32),
        truncated_B=np.array([r.truncated for r in rows], bool),
        tool_calls_B=tools[:, 0].astype(np.int32), tool_errors_B=tools[:, 1].astype(np.int32),
        tool_timeouts_B=tools[:, 2].astype(np.int32), tool_latency_s_B=tools[:, 3],
        vocab_errors_B=np.array([r.vocab_error is not None for r in rows], np.int32),
        vocab_error=next((r.vocab_error for r in rows if r.vocab_error is not None), None),
        env_time_s=env_time, env_wait_s=env_wait, decode_steps=decode_steps, wall_s=wall_s)
