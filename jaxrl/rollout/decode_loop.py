"""The RL driver of the engine: a batch of rows planned, begun, advanced and read out.

    setup    = decode_setup(model.config, engine_config, P, L, B, C, stop_ids, sampling)   static
    progress = begin(model, setup, prompts, row_keys_B, limit_B, ...)  prefill, first tokens
    progress = advance(model, setup, progress, row_keys_B)             decode until all end
    rollout  = to_rollout(progress.out, prompts, G, progress.slot_steps)

`advance` is one `lax.while_loop` over the engine's ops (`jaxrl.rollout.slots`): whenever
slots are free it inserts the next pending rows (continuous batching; `static` waits until
every slot is free, then inserts a whole batch), then every live slot decodes one token,
written into the rows' [B, C] outputs where it is drawn. A row ends at its first stop token
(kept) or its own limit (`limit_B`, per-request limits as servers have); a row that ends on
its first token (drawn at prefill) never takes a slot. The G samples of a prompt read its
pages (one home per prompt).

With `stop_at` it stops after that many iterations in all; the `InProgress` it returns goes
on in a later call, in another program, even under other weights (in-flight weight updates:
`jaxrl.rollout.inflight`). A row's token t is drawn with fold_in(key_r, t), so where the
pieces stop changes no token when the weights stay the same. `rollout` is the one-piece
loop (with `min_slots`: in tiers of ever fewer slots, `slots.shrink`), `sample_continuous`
the dense sampler's interface on it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from jaxrl.models import Transformer
from jaxrl.models.paged_attention import resolve_impl
from jaxrl.rollout import slots
from jaxrl.rollout.pages import PoolLayout, own_pages
from jaxrl.rollout.settings import Batching, EngineConfig, PagedAttentionSettings, SamplingParams
from jaxrl.rollout.slot_count import max_concurrent_decodes, slot_tiers, tail_min_slots
from jaxrl.rollout.types import Rollout, SamplerConfig, row_keys, row_limits
from jaxrl.sharding import constrain, use_rules
from jaxrl.sharding.rules import active_rules


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    """The static part of one rollout: its pool, engine settings (attention resolved), group
    size, stop tokens and sampling; `decode_setup` makes it from the shapes of the call."""

    layout: PoolLayout
    config: EngineConfig
    group_size: int
    end_token_ids: tuple[int, ...]
    sampling: SamplingParams

    @property
    def stops(self) -> slots.Stops:
        return slots.Stops(row_ids=tuple(self.end_token_ids))


def decode_setup(model_config, config: EngineConfig, num_prompts: int, prompt_len: int,
                 num_rows: int, max_new_tokens: int, end_token_ids: tuple[int, ...],
                 sampling: SamplingParams) -> DecodeSetup:
    """The `DecodeSetup` of `num_rows` rows of `num_prompts` prompts up to `prompt_len` tokens."""
    num_slots = max_concurrent_decodes(config, num_rows)
    layout = PoolLayout.plan(page_size=config.page_size, num_prompts=num_prompts,
                             prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                             num_slots=num_slots, row_pages=config.row_pages)
    config = dataclasses.replace(config, attention=resolve_impl(
        config.attention, model_config, num_slots=num_slots, num_pages=layout.num_pages,
        page_size=layout.page_size, table_width=layout.table_width))
    return DecodeSetup(layout, config, num_rows // num_prompts, tuple(end_token_ids), sampling)


@struct.dataclass
class Outputs:
    """The rows' completions, filled as tokens are drawn ([B, C])."""

    tokens_BxC: jax.Array
    mask_BxC: jax.Array
    logp_BxC: jax.Array
    logp_raw_BxC: jax.Array


@struct.dataclass
class InProgress:
    """A rollout between two decode iterations: all the loop carries, so it can stop after
    any iteration and go on in another program, with other weights (`advance`)."""

    state: slots.SlotState
    out: Outputs
    length_P: jax.Array  # prompt lengths
    home_B: jax.Array  # the home (prompt) of each row
    first_B: jax.Array  # each row's first token (drawn at prefill)
    limit_B: jax.Array
    queue_B: jax.Array  # rows in the order they take slots (those that ended at once last)
    num_queued: jax.Array
    next_: jax.Array  # queue position of the next row to start
    steps: jax.Array  # decode iterations run
    slot_steps: jax.Array  # slots those iterations ran, live or not

    @property
    def finished(self) -> jax.Array:
        return (self.next_ >= self.num_queued) & ~jnp.any(self.state.live_S)


def begin(model: Transformer, setup: DecodeSetup, prompt_ids_PxL: jax.Array,
          prompt_mask_PxL: jax.Array, row_keys_B: jax.Array, limit_B: jax.Array,
          max_new_tokens: int, pad_token_id: int, home_B: jax.Array | None = None
          ) -> InProgress:
    """An empty pool, the prompts prefilled into their home pages and every row's first token
    drawn; no decode iteration run yet. `home_B`: each row's prompt (default: row // G)."""
    b, c, g = row_keys_B.shape[0], max_new_tokens, setup.group_size
    if home_B is None:
        home_B = jnp.arange(b, dtype=jnp.int32) // g
    state = slots.init(model.config, setup.layout, max_concurrent_decodes(setup.config, b))
    prefix = slots.prefill(model, prompt_ids_PxL, prompt_mask_PxL)
    num_prompts = prefix.length_P.shape[0]
    state = slots.write_prompts(state, setup.layout, prefix.kv_LxPxLx2KxH, prefix.length_P,
                                jnp.arange(num_prompts, dtype=jnp.int32))
    token_B, logp_B, logp_raw_B = slots.first_tokens(
        prefix.logits_PxV[home_B], jax.random.key_data(row_keys_B), setup.sampling)
    done_B, _ = setup.stops.ends(token_B, 0, 1, limit_B)
    out = Outputs(jnp.full((b, c), pad_token_id, jnp.int32).at[:, 0].set(token_B),
                  jnp.zeros((b, c), bool).at[:, 0].set(True),
                  jnp.zeros((b, c), jnp.float32).at[:, 0].set(logp_B),
                  jnp.zeros((b, c), jnp.float32).at[:, 0].set(logp_raw_B))
    # Rows that ended on their first token never take a slot; the others queue in row order.
    queue_B = jnp.argsort(done_B, stable=True).astype(jnp.int32)
    zero = jnp.int32(0)
    return InProgress(state, out, prefix.length_P, home_B, token_B, limit_B, queue_B,
                      jnp.sum(~done_B, dtype=jnp.int32), zero, zero, zero)


def admit(progress: InProgress, layout: PoolLayout, batching: Batching
          ) -> tuple[jax.Array, jax.Array]:
    """(slot_row_S, next'): the next queued rows for the free slots, in queue order, as many
    as there are free slots and free pages for (static batching: only when all are free)."""
    state, queue_B, next_ = progress.state, progress.queue_B, progress.next_
    num_slots = state.row_S.shape[0]
    free_S = ~state.live_S
    if batching == "static":
        free_S &= ~jnp.any(state.live_S)
    rank_S = jnp.cumsum(free_S) - 1  # the k-th free slot takes the k-th candidate
    k_K = jnp.arange(num_slots)
    row_K = queue_B[jnp.clip(next_ + k_K, 0, queue_B.shape[0] - 1)]
    need_K = own_pages(progress.length_P[progress.home_B[row_K]], progress.limit_B[row_K],
                       layout.page_size)
    ok_K = (next_ + k_K < progress.num_queued) & (jnp.cumsum(need_K) <= state.free.count) & (
        k_K < jnp.sum(free_S))
    ok_K = jnp.cumprod(ok_K).astype(bool)  # a prefix: rows start in queue order
    k = jnp.sum(ok_K, dtype=jnp.int32)
    rank_S = jnp.clip(rank_S, 0, num_slots - 1)
    slot_row_S = jnp.where(free_S & (rank_S < k), row_K[rank_S], -1)
    return slot_row_S, next_ + k


def _insert(progress: InProgress, setup: DecodeSetup, row_keys_B: jax.Array) -> InProgress:
    slot_row_S, next_ = admit(progress, setup.layout, setup.config.batching)
    row_S = jnp.maximum(slot_row_S, 0)
    home_S = progress.home_B[row_S]
    zeros = jnp.zeros(row_S.shape, jnp.float32)  # a row's first log-probs are in the outputs
    starts = slots.Starts(slot_row_S, home_S, progress.length_P[home_S], progress.first_B[row_S],
                          zeros, zeros, jax.random.key_data(row_keys_B)[row_S],
                          progress.limit_B[row_S])
    return progress.replace(state=slots.insert(progress.state, setup.layout, starts, setup.stops),
                            next_=next_)


def _write(out: Outputs, drawn: slots.Drawn) -> Outputs:
    """Each live slot's drawn token into its row's outputs (free slots write nothing)."""
    row_S = jnp.where(drawn.row_S >= 0, drawn.row_S, out.tokens_BxC.shape[0])
    col_S = drawn.index_S
    return Outputs(out.tokens_BxC.at[row_S, col_S].set(drawn.token_S, mode="drop"),
                   out.mask_BxC.at[row_S, col_S].set(True, mode="drop"),
                   out.logp_BxC.at[row_S, col_S].set(drawn.logp_S, mode="drop"),
                   out.logp_raw_BxC.at[row_S, col_S].set(drawn.logp_raw_S, mode="drop"))


def iteration(model: Transformer, setup: DecodeSetup, p: InProgress, row_keys_B: jax.Array,
              attention: PagedAttentionSettings | None = None) -> InProgress:
    """One decode iteration (the body of `advance`'s loop): the next queued rows into the
    free slots, then one token for every live slot, written into the rows' outputs.
    `attention`: how the slots read the pool (default the setup's; FLOP accounting unrolls
    it, `jaxrl.step.rollout_programs`)."""
    # Only while rows wait and a slot is free (most iterations skip the bookkeeping).
    p = jax.lax.cond((p.next_ < p.num_queued) & ~jnp.all(p.state.live_S),
                     lambda p: _insert(p, setup, row_keys_B), lambda p: p, p)
    state, drawn = slots.generate(model, p.state, setup.layout, attention or setup.config.read,
                                  setup.stops, setup.sampling)
    return p.replace(state=state, out=_write(p.out, drawn), steps=p.steps + 1,
                     slot_steps=p.slot_steps + state.row_S.shape[0])


def advance(model: Transformer, setup: DecodeSetup, progress: InProgress, row_keys_B: jax.Array,
            stop_at: jax.Array | None = None, below: int = 0) -> InProgress:
    """Decode iterations until every row has finished (with `below`: until no row waits and
    at most `below` rows live), or until `stop_at` iterations have run in all."""
    graphdef, weights = nnx.split(model)
    num_queued = progress.num_queued

    def body(p: InProgress) -> InProgress:
        # NNX transforms reject Variables made at another trace level: a fresh copy here.
        return iteration(nnx.merge(graphdef, weights, copy=True), setup, p, row_keys_B)

    def cond(p: InProgress) -> jax.Array:
        work = (p.next_ < num_queued) | (jnp.sum(p.state.live_S) > below)
        return work if stop_at is None else work & (p.steps < stop_at)

    return jax.lax.while_loop(cond, body, progress)


def rollout(model: Transformer, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
            row_keys_B: jax.Array, limit_B: jax.Array, max_new_tokens: int,
            config: EngineConfig, *, end_token_ids: tuple[int, ...], pad_token_id: int,
            sampling: SamplingParams, home_B: jax.Array | None = None
            ) -> tuple[Outputs, jax.Array, jax.Array]:
    """(outputs, iterations, slot steps): every row's completion ([B, C]), the decode
    iterations run and the slots they ran (live or not) summed.

    `config.min_slots` (`tail_min_slots`): once no row waits, whenever the live rows fit in
    half the slots they move there (`slots.shrink`), down to `min_slots`: each tier is its
    own `while_loop`, so one more compiled decode step, and the tail of long rows stops
    paying for free slots."""
    num_prompts, prompt_len = prompt_ids_PxL.shape
    setup = decode_setup(model.config, config, num_prompts, prompt_len, row_keys_B.shape[0],
                         max_new_tokens, end_token_ids, sampling)
    progress = begin(model, setup, prompt_ids_PxL, prompt_mask_PxL, row_keys_B, limit_B,
                     max_new_tokens, pad_token_id, home_B)
    num_slots = progress.state.row_S.shape[0]
    tiers = slot_tiers(num_slots, tail_min_slots(config, num_slots, max_new_tokens))
    for k, num_slots in enumerate(tiers):
        if k:
            progress = progress.replace(state=slots.shrink(progress.state, num_slots))
        # Tier k runs while rows wait or more rows live than the next tier has slots.
        below = tiers[k + 1] if k + 1 < len(tiers) else 0
        progress = advance(model, setup, progress, row_keys_B, below=below)
    return progress.out, progress.steps, progress.slot_steps


def rollout_on_mesh(model: Transformer, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
                    row_keys_B: jax.Array, limit_B: jax.Array, max_new_tokens: int,
                    config: EngineConfig, **kw) -> tuple[Outputs, jax.Array, jax.Array]:
    """`rollout`, its rows, slots and pages split over the devices of the rollout layout's
    batch axes (under `use_rules`; elsewhere, or when they do not divide the rows, `rollout`).

    Each device runs the loop on its share of the rows (B / D, contiguous) with its share of
    the slots (`max_slots` / D, at least 2) over a pool of its own: it holds and attends only
    its own slots' keys and values, and refills a slot from its own rows. A row's tokens do
    not depend on D (its key is its own). The prompts go with their rows when D divides them
    (G samples of a prompt are contiguous); otherwise every device prefills every prompt.

    Collectives per decode iteration: none over the batch axes (each device's loop runs its
    own trip count); over `tensor`, the model's own (its heads and vocabulary are split there,
    as in the dense forward: an all-reduce after attention and after the MLP per layer, and
    the logits' gather for sampling). After the loop, the iteration counts are reduced once.
    """
    active = active_rules()
    b, num_prompts = row_keys_B.shape[0], prompt_ids_PxL.shape[0]
    axes = () if active is None else row_axes(*active, b)
    if not axes:
        return rollout(model, prompt_ids_PxL, prompt_mask_PxL, row_keys_B, limit_B,
                       max_new_tokens, config, **kw)
    mesh, rules = active
    d = math.prod(mesh.shape[a] for a in axes)
    rows = P(axes)
    prompts = rows if num_prompts % d == 0 else P()
    local, home_B = device_share(config, b, num_prompts, d)
    graphdef, weights = nnx.split(model)

    def per_device(weights, ids_PxL, mask_PxL, keys_BxK, limit_B, home_B):
        with use_rules(jax.sharding.get_abstract_mesh(), rules.without(axes)):
            out, steps, slot_steps = rollout(
                nnx.merge(graphdef, weights), ids_PxL, mask_PxL,
                jax.random.wrap_key_data(keys_BxK), limit_B, max_new_tokens, local,
                home_B=home_B, **kw)
        return out, steps[None], slot_steps[None]

    out, steps_D, slot_steps_D = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), prompts, prompts, rows, rows, rows),
        out_specs=(rows, rows, rows), axis_names=set(axes), check_vma=False)(
        weights, prompt_ids_PxL, prompt_mask_PxL, jax.random.key_data(row_keys_B), limit_B,
        home_B)
    return out, jnp.max(steps_D), jnp.sum(slot_steps_D)


def device_share(config: EngineConfig, num_rows: int, num_prompts: int, d: int
                 ) -> tuple[EngineConfig, jax.Array]:
    """(one device's engine settings, home_B) when `d` devices split the rows: its share of
    the slots (at least 2) and row pages, and each row's home among its device's prompts
    (the prompts go with their rows when `d` divides them; otherwise each device has all)."""
    home_B = jnp.arange(num_rows, dtype=jnp.int32) // (num_rows // num_prompts)
    if num_prompts % d == 0:  # each device's rows are its own prompts' rows
        home_B = home_B % (num_prompts // d)
    local = dataclasses.replace(
        config, max_slots=None if config.max_slots is None else max(2, -(-config.max_slots // d)),
        row_pages=None if config.row_pages is None else -(-config.row_pages // d))
    return local, home_B


def row_axes(mesh, rules, num_rows: int) -> tuple[str, ...]:
    """The mesh axes `rollout_on_mesh` splits `num_rows` rows over: the batch axes of
    `rules` (of size > 1) whose product divides the rows."""
    axes = tuple(a for a in rules.mesh_axes("batch") if mesh.shape.get(a, 1) > 1)
    while axes and num_rows % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes


def row_shards(mesh, rules, num_rows: int) -> int:
    """How many ways `rollout_on_mesh` splits `num_rows` rows (1: not split; no mesh)."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in row_axes(mesh, rules,
                                                                            num_rows))


def to_rollout(out: Outputs, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
               group_size: int, slot_steps: jax.Array) -> Rollout:
    """The finished rows' outputs as the dense sampler's `Rollout`, laid out by rows."""
    def repeat(x):
        return jnp.repeat(x, group_size, axis=0)

    tokens_BxC, mask_BxC, logp_BxC, logp_raw_BxC, ids_BxL, pmask_BxL = (
        constrain(x, ("batch", "seq")) for x in (
            out.tokens_BxC, out.mask_BxC, out.logp_BxC, out.logp_raw_BxC,
            repeat(prompt_ids_PxL), repeat(prompt_mask_PxL.astype(bool))))
    return Rollout(prompt_ids_BxP=ids_BxL, prompt_mask_BxP=pmask_BxL,
                   completion_ids_BxC=tokens_BxC, completion_mask_BxC=mask_BxC,
                   logp_BxC=logp_BxC, logp_raw_BxC=logp_raw_BxC,
                   num_steps=jnp.max(jnp.sum(mask_BxC, axis=1, dtype=jnp.int32)),
                   decode_slot_steps=slot_steps)


def sample_continuous(model: Transformer, prompt_ids_PxL: jax.Array, prompt_mask_PxL: jax.Array,
                      key: jax.Array, config: SamplerConfig,
                      limit_B: jax.Array | None = None) -> Rollout:
    """`dense_reference.sample_dense` on the engine: the same Rollout, row for row (pure; call
    under jit).

    `limit_B` (int32 [B]) caps each row's new tokens (default: all `config.max_new_tokens`).
    """
    num_prompts = prompt_ids_PxL.shape[0]
    n = config.num_generations
    keys_B = row_keys(key, num_prompts, n)
    limit_B = row_limits(limit_B, keys_B.shape[0], config.max_new_tokens)
    out, _, slot_steps = rollout_on_mesh(
        model, prompt_ids_PxL, prompt_mask_PxL, keys_B, limit_B, config.max_new_tokens,
        engine_config(config, keys_B.shape[0]), end_token_ids=config.end_token_ids,
        pad_token_id=config.pad_token_id, sampling=config.sampling)
    return to_rollout(out, prompt_ids_PxL, prompt_mask_PxL, n, slot_steps)


def engine_config(config: SamplerConfig, num_rows: int) -> EngineConfig:
    """The sampler's engine settings (none given: every row in its own slot)."""
    return config.engine or EngineConfig(max_slots=num_rows)
