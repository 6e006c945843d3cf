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
(`jaxrl.envs.base.observation_problem`: an Observation, a finite reward), every call is
timed against `env_timeout_s`, and the calls run on daemon threads (`env_calls.py`), so an
exception, a broken contract or a hang ends the rollout with `EnvFailure` naming the row and
turn, and a hung call never keeps the process alive. Token ids outside the model's
vocabulary (given, or what a text encodes to: `encoded_problem`) are counted instead (in
`MultiTurnRollout.vocab_errors_B` and the sample's tool errors, the first one's message
kept): that observation is never fed and its episode ends there.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.envs.base import (
    EnvFailure,
    Environment,
    Observation,
    encoded_problem,
    observation_ids,
    observation_problem,
)
from jaxrl.models import Transformer
from jaxrl.models.paged_attention import resolve_impl
from jaxrl.rollout import slots
from jaxrl.rollout.episode_rows import MultiTurnRollout, Row, assemble
from jaxrl.rollout.pages import PoolLayout
from jaxrl.rollout.settings import SamplingParams
from jaxrl.rollout.slots_on_mesh import SlotSplit
from jaxrl.rollout.types import row_keys
from jaxrl.sharding import AxisRules, state_shardings
from jaxrl.step.env_calls import EnvCalls
from jaxrl.step.multiturn_config import MultiTurnConfig


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


def rollout_multiturn(model: Transformer, prompt_ids_BxP, prompt_mask_BxP,
                      envs: Sequence[Environment], encode: Callable[[str], list[int]],
                      decode: Callable[[list[int]], str], key: jax.Array,
                      config: MultiTurnConfig, sampling: SamplingParams | None = None,
                      *, num_generations: int | None = None, mesh: Mesh | None = None,
                      rules: AxisRules | None = None) -> MultiTurnRollout:
    """Runs every row's episode (see the module docstring); `envs[r]` is row r's
    environment. Prompts are left-padded, B = prompts x num_generations rows, prompt-major;
    `key` is one key (or one per prompt), split per row as the RL engine does;
    `sampling` and `num_generations` default to `config.generation`'s. On `mesh` (`rules`:
    the rollout rules) the weights are laid out by the rules once, and the slots split over
    the devices."""
    began = time.perf_counter()
    sampling = config.generation.sampling if sampling is None else sampling
    num_generations = num_generations or config.generation.num_generations
    ids_BxP, mask_BxP = _checked_prompts(prompt_ids_BxP, prompt_mask_BxP, len(envs),
                                         num_generations)
    b, p = ids_BxP.shape
    device = _Device.build(model, config, sampling, p, mesh, rules)
    key_data_BxK = jax.random.key_data(row_keys(key, b // num_generations, num_generations))
    host = _Episodes(device, config, ids_BxP, mask_BxP, key_data_BxK, num_generations, envs,
                     encode, decode, model.config.vocab_size)
    host.run()
    return assemble(host.rows, ids_BxP, mask_BxP, config, host.env_time, host.env_wait,
                    host.decode_steps, time.perf_counter() - began)


def _checked_prompts(prompt_ids_BxP, prompt_mask_BxP, num_envs: int,
                     g: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids_BxP int32, mask_BxP bool) of B = prompts x g rows, one environment each, every
    prompt non-empty; ValueError otherwise."""
    ids_BxP, mask_BxP = np.asarray(prompt_ids_BxP, np.int32), np.asarray(prompt_mask_BxP, bool)
    b = ids_BxP.shape[0]
    if b % g or num_envs != b:
        raise ValueError(f"{b} rows must be prompts x {g} generations, with one environment "
                         f"each (got {num_envs})")
    if not mask_BxP.any(axis=1).all():
        raise ValueError(f"rows {np.flatnonzero(~mask_BxP.any(axis=1)).tolist()} have an "
                         f"empty prompt")
    return ids_BxP, mask_BxP


@dataclasses.dataclass
class _Device:
    """The device side of a rollout: the slots' state (donated to each operation and
    replaced by its result) and the jitted operations on it, with their static settings."""

    graphdef: Any
    weights: Any
    split: SlotSplit
    layout: PoolLayout
    stops: slots.Stops
    sampling: SamplingParams
    attention: slots.PagedAttentionSettings
    config: MultiTurnConfig
    state: Any

    @classmethod
    def build(cls, model: Transformer, config: MultiTurnConfig, sampling: SamplingParams,
              prompt_len: int, mesh: Mesh | None, rules: AxisRules | None) -> _Device:
        """The weights (laid out by `rules` on `mesh`) and empty slots split over it."""
        split = SlotSplit.over(mesh, rules, config.num_slots)
        layout = config.layout(prompt_len, split.local_slots)
        graphdef, weights = nnx.split(model)
        if mesh is not None:
            weights = jax.device_put(weights, state_shardings(weights, mesh, rules))
        attention = dataclasses.replace(config.attention, impl=resolve_impl(
            config.attention.impl, model.config, num_slots=split.local_slots,
            num_pages=layout.num_pages, page_size=layout.page_size,
            table_width=layout.table_width))
        return cls(graphdef, weights, split, layout, config.stops, sampling, attention, config,
                   _init(model.config, split, layout))

    def prefill(self, ids_P: np.ndarray, mask_P: np.ndarray):
        """The prompt's prefix (its KV), on every device."""
        return _prefill(self.graphdef, self.split, self.weights, ids_P, mask_P)

    def start(self, prefix, key_K: np.ndarray, slot: int) -> None:
        """`slot` starts a row of the prefix's prompt, its budget max_total_tokens."""
        self.state = _start(self.split, self.state, prefix, key_K, np.int32(slot),
                            self.config.max_total_tokens, self.layout, self.stops,
                            self.sampling)

    def step(self) -> slots.Sent:
        """The tokens drawn at the previous step, after dispatching one decode step."""
        self.state, out = _step(self.graphdef, self.split, self.weights, self.state,
                                self.layout, self.stops, self.sampling, self.attention)
        return out

    def extend(self, slot: int, chunk: list[int]) -> None:
        """Feeds `chunk` to the slot, chunk_width tokens per `extend` call (the last draws)."""
        w = self.config.chunk_width
        for i in range(0, len(chunk), w):
            piece = chunk[i:i + w]
            ids_W = np.full((w,), self.config.pad_token_id, np.int32)
            ids_W[:len(piece)] = piece
            self.state = _extend(self.graphdef, self.split, self.weights, self.state,
                                 np.int32(slot), ids_W, np.int32(len(piece)),
                                 np.bool_(i + w >= len(chunk)), self.layout, self.stops,
                                 self.sampling)


class _Episodes:
    """The host side of a rollout: every row's episode so far, which row each slot holds and
    the environments' calls; `run` alternates them with the device until every row is done."""

    def __init__(self, device: _Device, config: MultiTurnConfig, ids_BxP: np.ndarray,
                 mask_BxP: np.ndarray, key_data_BxK, g: int, envs: Sequence[Environment],
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 vocab_size: int):
        self.device, self.config = device, config
        self.ids_BxP, self.mask_BxP, self.key_data_BxK, self.g = ids_BxP, mask_BxP, key_data_BxK, g
        self.envs, self.encode, self.decode, self.vocab_size = envs, encode, decode, vocab_size
        self.eos = set(config.eos_token_ids)
        self.rows = [Row() for _ in range(len(ids_BxP))]
        self.owner: dict[int, int] = {}       # slot -> row
        self.next_row, self.prefix, self.prefix_of = 0, None, -1
        self.env_time = self.env_wait = 0.0
        self.decode_steps = 0
        self.calls = EnvCalls(config.env_workers or config.num_slots)

    def run(self) -> None:
        """The host loop (module doc): the environments' answers, new rows into free slots,
        then a decode step while some slot decodes, else a wait on the environments.

        Step k + 1 is dispatched before step k's tokens are read, so the device decodes while
        the host reads them (a slot whose turn ended at step k idles in step k + 1: its
        turn's end is decided on the device; the host learns it one step later)."""
        unread, calls = None, self.calls
        try:
            while True:
                self.take_answers()
                self.fill_slots()
                if len(self.owner) > len(calls.waiting):  # some slot decodes (host's view)
                    out = self.device.step()
                    self.decode_steps += 1
                    if unread is not None:
                        self.take_tokens(unread)
                    unread = out
                elif unread is not None:
                    self.take_tokens(unread)
                    unread = None
                elif calls.waiting:
                    idle = time.perf_counter()
                    calls.wait(self.config.env_timeout_s)
                    self.env_wait += time.perf_counter() - idle
                else:
                    break
        finally:
            calls.close()  # a call past its limit is left on its daemon thread

    def take_answers(self) -> None:
        """The environments' finished calls into their rows; EnvFailure for a call that
        raised or is past env_timeout_s."""
        for slot, future in self.calls.done():
            r, turn = self.owner[slot], len(self.rows[self.owner[slot]].ends)
            try:
                obs, seconds = future.result()
            except Exception as e:
                raise EnvFailure(f"env.step(turn) raised {type(e).__name__}: {e}", row=r,
                                 turn=turn) from e
            self.env_time += seconds
            self.take_observation(slot, obs)
        if (late := self.calls.overdue(self.config.env_timeout_s)) is not None:
            slot, seconds = late
            raise EnvFailure(f"env.step(turn) did not return within the time limit "
                             f"(data.env_timeout_s={self.config.env_timeout_s:g}; "
                             f"{seconds:.1f} s so far)", row=self.owner[slot],
                             turn=len(self.rows[self.owner[slot]].ends))

    def fill_slots(self) -> None:
        """The next rows into the free slots, one device after another; a prompt is
        prefilled once for its g rows."""
        for slot in self.device.split.fill_order():
            if slot in self.owner or self.next_row == len(self.rows):
                continue
            if self.next_row // self.g != self.prefix_of:
                self.prefix_of = self.next_row // self.g
                self.prefix = self.device.prefill(self.ids_BxP[self.next_row],
                                                  self.mask_BxP[self.next_row])
            self.device.start(self.prefix, self.key_data_BxK[self.next_row], slot)
            self.owner[slot], self.next_row = self.next_row, self.next_row + 1

    def take_tokens(self, out: slots.Sent) -> None:
        """A step's tokens into their rows; a turn that ended goes to its environment."""
        out = jax.device_get(out)
        for slot in np.flatnonzero(out.valid_S).tolist():
            row = self.rows[self.owner[slot]]
            assert out.index_S[slot] == len(row.ids), (out.index_S[slot], len(row.ids))
            token = int(out.token_S[slot])
            row.add(token, False, out.logp_S[slot], out.logp_raw_S[slot])
            if out.ended_S[slot]:
                row.ends.append(len(row.ids))
                row.eos = token in self.eos
                text = self.decode(row.ids[row.starts[-1]:])
                self.calls.submit(slot, self.envs[self.owner[slot]], text)

    def take_observation(self, slot: int, obs: Observation) -> None:
        """The environment's answer to the slot's turn: its reward and tool stats into the
        row, then the episode ends (done, EOS, max_turns, no room) or the observation's
        tokens are fed to the slot (cut to the room left: then it ends too)."""
        r = self.owner[slot]
        row = self.rows[r]
        problem = observation_problem(obs)
        if problem is not None:
            raise EnvFailure(problem, row=r, turn=len(row.ends))
        if obs.reward is not None:
            row.reward = float(obs.reward)
        t = obs.tools
        row.tools += (t.calls, t.errors, t.timeouts, t.latency_s)
        if obs.done or row.eos:
            return self.finish(slot, False)
        if len(row.ends) >= self.config.max_turns:
            return self.finish(slot, True)
        room = self.config.max_total_tokens - len(row.ids)
        new = observation_ids(obs, self.encode, room)
        problem = (observation_problem(obs, self.vocab_size) if obs.ids is not None
                   else encoded_problem(new, self.vocab_size))
        if problem is not None:  # counted, never fed: the episode ends at this turn
            row.vocab_error = str(EnvFailure(problem, row=r, turn=len(row.ends)))
            row.tools[1] += 1  # one of the sample's tool/errors
            return self.finish(slot, True)
        if len(new) >= room:  # no room for a model token after it: cut, and the episode ends
            for token in new[:room]:
                row.add(token, True)
            return self.finish(slot, True)
        chunk = [row.ids[-1], *new]  # the turn's last token was not fed yet
        for token in new:
            row.add(token, True)
        row.starts.append(len(row.ids))
        self.device.extend(slot, chunk)

    def finish(self, slot: int, truncated: bool) -> None:
        """The slot's row is done; the slot is free."""
        self.rows[self.owner.pop(slot)].truncated = truncated
