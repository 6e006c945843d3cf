"""Multi-turn (agentic) rollouts: the policy and one environment per sample take turns.

    out = rollout_multiturn(model, prompt_ids_BxP, prompt_mask_BxP, envs, encode, decode,
                            key, config, sampling, num_generations=G)

Each of the B = prompts x G rows (prompt-major) alternates: the policy generates a turn
until a stop token (EOS or a tool call's end tag, kept), `max_turn_tokens` tokens or the
row's budget; the turn's text goes to the row's environment (`jaxrl.envs.base`:
`env.step(text) -> Observation`), in a worker thread; the observation's tokens are
appended to the same slot's sequence as one prefill chunk written into its KV pages
(`jaxrl.rollout.slots.extend`: the history is never prefilled again), and decoding goes on.
The device side is the engine's (`jaxrl.rollout.slots`): each slot is its row's prompt home,
a turn ends on the device (`slots.Stops`: a stop token, the turn's or the row's token cap),
and the host reads each token one step after it was drawn (`slots.take_pending`).

    completion = turn 1 | obs 1 | turn 2 | obs 2 | ... | turn k     (at most max_total_tokens)

The host loop runs every decode step for the slots that are decoding while the others wait
on their environment (continuous batching: no slot waits for another's tool); it polls the
environments' futures at every iteration, and a slot whose row finished takes the next row.
Row r's completion token t (model tokens only are drawn) is drawn with fold_in(key_r, t),
key_r the RL engine's row key (`decode_loop.row_keys`), so a row's tokens do not depend on
the slot count, the devices or the environments' timing.

On a mesh the slots and their pages are split over the rollout rules' batch axes
(`jaxrl.rollout.slots_on_mesh`, as a server's): each device decodes its own slots over a pool
of its own, a row starts and takes its observations on the device of its slot only, and the
host fills free slots one device after another. A prompt's prefill runs on every device.

Episode ends: the environment says `done` (that observation is not appended; its reward is
the row's), a turn ends on one of `eos_token_ids`, `max_turns` turns were taken, or the
budget is spent (an observation longer than the room left is cut to fit, and ends it: a
text is cut by characters before it is tokenized, so a megabyte of tool output costs
microseconds, not seconds). The environment sees every turn, the last one too (it may score
it). Rewards: the last one the environment gave, NaN where it gave none.

Environments are a user's code: every answer is checked against the contract
(`jaxrl.envs.base.observation_problem`: an Observation, a finite reward, ids inside the
model's vocabulary), every call is timed against `env_timeout_s`, and the calls run on
daemon threads (`env_calls.py`), so an exception, a broken contract or a hang ends the
rollout with `EnvFailure` naming the row and turn, and a hung call never keeps the process
alive.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.envs.base import EnvFailure, Environment, Observation, observation_problem
from jaxrl.models import Transformer
from jaxrl.rollout import slots
from jaxrl.rollout.episode_rows import MultiTurnRollout, Row, assemble
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.slots_on_mesh import SlotSplit
from jaxrl.rollout.types import row_keys
from jaxrl.sharding import AxisRules, state_shardings
from jaxrl.step.env_calls import EnvCalls


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """The static shape of a multi-turn rollout.

    max_turns: policy turns per episode. max_total_tokens: C, completion tokens per row
    (turns and observations). max_turn_tokens: tokens of one turn. stop_token_ids: end a turn
    (EOS and the tool call's end tag); eos_token_ids (added to them) also end the episode
    after the environment saw the turn. num_slots: rows decoded at once. chunk_width: tokens
    per `extend` call (an observation longer than chunk_width - 1 takes several).
    env_workers: threads running `env.step` (None: num_slots). env_timeout_s: the longest
    one `env.step` call may take (None: no limit).
    """

    max_turns: int
    max_total_tokens: int
    max_turn_tokens: int
    num_slots: int = 8
    page_size: int = 16
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    chunk_width: int = 64
    pad_token_id: int = 0
    env_workers: int | None = None
    env_timeout_s: float | None = None
    attention: str = "xla"

    def __post_init__(self):
        for name in ("max_turns", "max_total_tokens", "max_turn_tokens", "num_slots",
                     "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_width < 2:
            raise ValueError(f"chunk_width must be >= 2, got {self.chunk_width}")
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ValueError(f"env_timeout_s must be > 0 or None, got {self.env_timeout_s}")

    @property
    def stops(self) -> slots.Stops:
        """EOS ends the row (on the device: its pages go back); a stop token or the turn's
        `max_turn_tokens`-th token ends the turn; `max_total_tokens` is each row's limit."""
        return slots.Stops(row_ids=tuple(self.eos_token_ids),
                           turn_ids=tuple(dict.fromkeys(self.stop_token_ids + self.eos_token_ids)),
                           turn_tokens=self.max_turn_tokens)

    def layout(self, prompt_len: int, num_slots: int) -> PoolLayout:
        """A pool of `num_slots` slots (one device's): one prompt home per slot, and row
        pages for every slot's whole budget at once."""
        return PoolLayout.plan(page_size=self.page_size, num_prompts=num_slots,
                               prompt_len=prompt_len, max_new_tokens=self.max_total_tokens,
                               num_slots=num_slots)


# The device operations, jitted once per (model graph, shapes, settings): `weights` traced.
# Each runs on the slots' devices as `split` lays them out (`jaxrl.rollout.slots_on_mesh`).
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _init(model_config, split, layout):
    return split.init(model_config, layout)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill(graphdef, split, weights, ids_P, mask_P):
    with split.use_rules():  # one prompt, on every device: the owner of its slot reads it
        return slots.prefill(nnx.merge(graphdef, weights), ids_P[None], mask_P[None])


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8), donate_argnums=(1,))
def _start(split, state, prefix, key_K, slot, limit, layout, stops, sampling):
    """The slot starts a row of the prefix's prompt (its home: the slot), its first token
    drawn with fold_in(key, 0)."""
    return split.on_owner(lambda state, slot, prefix, key_K, limit: slots.insert_home(
        state, layout, prefix, slots.one_row(prefix, key_K, limit, sampling), slot, stops),
        state, slot, prefix, key_K, limit)


@functools.partial(jax.jit, static_argnums=(0, 1, 4, 5, 6, 7), donate_argnums=(3,))
def _step(graphdef, split, weights, state, layout, stops, sampling, attention):
    """The tokens drawn before (emitted now), then one decode step of every live slot."""
    def step(state, weights):
        state, sent = slots.take_pending(state)
        state, _ = slots.generate(nnx.merge(graphdef, weights), state, layout, attention, stops,
                                  sampling)
        return state, sent

    return split.on_each(step, state, weights)


@functools.partial(jax.jit, static_argnums=(0, 1, 8, 9, 10), donate_argnums=(3,))
def _extend(graphdef, split, weights, state, slot, ids_W, n, last, layout, stops, sampling):
    return split.on_owner(lambda state, slot, weights, ids_W, n, last: slots.extend(
        nnx.merge(graphdef, weights), state, layout, slot, ids_W, n, last, stops, sampling)[0],
        state, slot, weights, ids_W, n, last)


def jitted_ops():
    """The jitted device operations (their `_cache_size()` tells compilations)."""
    return {"init": _init, "prefill": _prefill, "start": _start, "step": _step,
            "extend": _extend}


def observation_ids(obs: Observation, encode: Callable[[str], list[int]],
                    limit: int | None = None) -> list[int]:
    """The tokens an observation appends: its ids, or its text encoded, or none; at most
    `limit` of them (None: all). A long text is cut by characters before it is encoded
    (`encode_prefix`)."""
    if obs.ids is not None:
        return [int(i) for i in obs.ids[:limit]]
    if not obs.text:
        return []
    return list(encode(obs.text)) if limit is None else encode_prefix(obs.text, encode, limit)


def encode_prefix(text: str, encode: Callable[[str], list[int]], limit: int) -> list[int]:
    """The first `limit` tokens of `text`, encoding only a prefix of it: 8 characters per
    token allowed at first (BPE vocabularies average 3-5 on text), doubled until the prefix
    gives more than `limit` tokens or is the whole text. Tokens near the cut could differ
    from the whole text's; taking one more token than kept keeps the cut away from them."""
    chars = 8 * (limit + 1)
    while True:
        ids = list(encode(text[:chars]))
        if len(ids) > limit or chars >= len(text):
            return ids[:limit]
        chars *= 2


def rollout_multiturn(model: Transformer, prompt_ids_BxP, prompt_mask_BxP,
                      envs: Sequence[Environment], encode: Callable[[str], list[int]],
                      decode: Callable[[list[int]], str], key: jax.Array,
                      config: MultiTurnConfig, sampling: SamplingParams | None = None,
                      *, num_generations: int = 1, mesh: Mesh | None = None,
                      rules: AxisRules | None = None) -> MultiTurnRollout:
    """Runs every row's episode (see the module docstring); `envs[r]` is row r's
    environment. Prompts are left-padded, B = prompts x num_generations rows, prompt-major;
    `key` is one key (or one per prompt), split per row as the RL engine does;
    `sampling` defaults to temperature 1, no filter. On `mesh` (`rules`: the rollout rules)
    the weights are laid out by the rules once, and the slots split over the devices."""
    began = time.perf_counter()
    sampling = SamplingParams() if sampling is None else sampling
    ids_BxP, mask_BxP = np.asarray(prompt_ids_BxP, np.int32), np.asarray(prompt_mask_BxP, bool)
    b, p = ids_BxP.shape
    g = num_generations
    if b % g or len(envs) != b:
        raise ValueError(f"{b} rows must be prompts x {g} generations, with one environment "
                         f"each (got {len(envs)})")
    if not mask_BxP.any(axis=1).all():
        raise ValueError(f"rows {np.flatnonzero(~mask_BxP.any(axis=1)).tolist()} have an "
                         f"empty prompt")
    c, w = config.max_total_tokens, config.chunk_width
    split = SlotSplit.over(mesh, rules, config.num_slots)
    layout, stops = config.layout(p, split.local_slots), config.stops
    eos = set(config.eos_token_ids)
    graphdef, weights = nnx.split(model)
    if mesh is not None:
        weights = jax.device_put(weights, state_shardings(weights, mesh, rules))
    key_data_BxK = jax.random.key_data(row_keys(key, b // g, g))
    state = _init(model.config, split, layout)
    rows = [Row() for _ in range(b)]
    owner: dict[int, int] = {}            # slot -> row
    vocab_size = model.config.vocab_size
    next_row, prefix, prefix_of = 0, None, -1
    env_time = env_wait = 0.0
    decode_steps = 0

    def finish(slot, truncated):
        rows[owner.pop(slot)].truncated = truncated

    def take_observation(slot, obs: Observation):
        nonlocal state
        r = owner[slot]
        row = rows[r]
        problem = observation_problem(obs, vocab_size)
        if problem is not None:
            raise EnvFailure(problem, row=r, turn=len(row.ends))
        if obs.reward is not None:
            row.reward = float(obs.reward)
        t = obs.tools
        row.tools += (t.calls, t.errors, t.timeouts, t.latency_s)
        if obs.done or row.eos:
            return finish(slot, False)
        if len(row.ends) >= config.max_turns:
            return finish(slot, True)
        room = c - len(row.ids)
        new = observation_ids(obs, encode, room)
        if len(new) >= room:  # no room for a model token after it: cut, and the episode ends
            for token in new[:room]:
                row.add(token, True)
            return finish(slot, True)
        chunk = [row.ids[-1], *new]  # the turn's last token was not fed yet
        for token in new:
            row.add(token, True)
        row.starts.append(len(row.ids))
        for i in range(0, len(chunk), w):
            piece = chunk[i:i + w]
            ids_W = np.full((w,), config.pad_token_id, np.int32)
            ids_W[:len(piece)] = piece
            state = _extend(graphdef, split, weights, state, np.int32(slot), ids_W,
                            np.int32(len(piece)), np.bool_(i + w >= len(chunk)), layout, stops,
                            sampling)

    def take_tokens(out: slots.Sent, calls: EnvCalls):
        """A step's tokens into their rows; a turn that ended goes to its environment."""
        out = jax.device_get(out)
        for slot in np.flatnonzero(out.valid_S).tolist():
            row = rows[owner[slot]]
            assert out.index_S[slot] == len(row.ids), (out.index_S[slot], len(row.ids))
            token = int(out.token_S[slot])
            row.add(token, False, out.logp_S[slot], out.logp_raw_S[slot])
            if out.ended_S[slot]:
                row.ends.append(len(row.ids))
                row.eos = token in eos
                text = decode(row.ids[row.starts[-1]:])
                calls.submit(slot, envs[owner[slot]], text)

    # Step k + 1 is dispatched before step k's tokens are read, so the device decodes while
    # the host reads them (a slot whose turn ended at step k idles in step k + 1: its
    # turn's end is decided on the device; the host learns it one step later).
    unread = None
    calls = EnvCalls(config.env_workers or config.num_slots)
    try:
        while True:
            for slot, future in calls.done():
                r, turn = owner[slot], len(rows[owner[slot]].ends)
                try:
                    obs, seconds = future.result()
                except Exception as e:
                    raise EnvFailure(f"env.step(turn) raised {type(e).__name__}: {e}", row=r,
                                     turn=turn) from e
                env_time += seconds
                take_observation(slot, obs)
            if (late := calls.overdue(config.env_timeout_s)) is not None:
                slot, seconds = late
                raise EnvFailure(f"env.step(turn) did not return within the time limit "
                                 f"(data.env_timeout_s={config.env_timeout_s:g}; "
                                 f"{seconds:.1f} s so far)", row=owner[slot],
                                 turn=len(rows[owner[slot]].ends))
            for slot in split.fill_order():
                if slot in owner or next_row == b:
                    continue
                if next_row // g != prefix_of:
                    prefix_of = next_row // g
                    prefix = _prefill(graphdef, split, weights, ids_BxP[next_row],
                                      mask_BxP[next_row])
                state = _start(split, state, prefix, key_data_BxK[next_row], np.int32(slot), c,
                               layout, stops, sampling)
                owner[slot], next_row = next_row, next_row + 1
            if len(owner) > len(calls.waiting):  # some slot decodes (as far as the host knows)
                state, out = _step(graphdef, split, weights, state, layout, stops, sampling,
                                   slots.Attention(config.attention))
                decode_steps += 1
                if unread is not None:
                    take_tokens(unread, calls)
                unread = out
            elif unread is not None:
                take_tokens(unread, calls)
                unread = None
            elif calls.waiting:
                idle = time.perf_counter()
                calls.wait(config.env_timeout_s)
                env_wait += time.perf_counter() - idle
            else:
                break
    finally:
        calls.close()  # a call past its limit is left on its daemon thread
    return assemble(rows, ids_BxP, mask_BxP, config, env_time, env_wait,
                     decode_steps, time.perf_counter() - began)
