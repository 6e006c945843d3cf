"""The trainer's forward: the policy's hidden states and log-probs at the completion tokens.

    hidden_BxCxE      = completion_hidden(model, batch)         (+ MoE router statistics)
    logp_BxC, H_BxC   = completion_log_probs(model, batch, T)   log-probs and entropies at T

    outputs_BxC       = completion_outputs(modules, batch, per_token)   any per-token heads,
                                                                        padded or packed
    total, group, budgets = microbatching(cfg, ...)                    how a batch is cut

The hidden state at position t predicts token t + 1, so completion token i is read at
P - 1 + i. With packing (`jaxrl.step.packing`, algo.packing) a microbatch's rows run end to
end in fewer rows and the outputs are gathered back to [B, C]: the same numbers. `prompt_group` decides when the G rows of a group run their shared prompt once
(`Transformer.hidden_states_shared_prompt`: same numbers, the prompt's work G-fold smaller).
Used by the updates (`jaxrl.step.updates`), the critic (`jaxrl.step.critic`) and the FLOP
accounting (`jaxrl.step.accounting`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config.algo import AlgoSection, resolve_logprob_chunk
from jaxrl.models import ModelConfig
from jaxrl.models.dense import dense
from jaxrl.rl import chunked_log_probs_and_entropy, token_entropy, token_log_probs
from jaxrl.sharding.rules import active_rules, constrain
from jaxrl.step import packing

UpdateBatch = dict[str, jax.Array]


def prompt_group(cfg: AlgoSection, model_config: ModelConfig, group_size: int, rows: int,
                 slices: int, batch_shards: int = 1) -> int:
    """Rows sharing one prompt within each of `slices` strided row slices (`_split`) of a
    batch of `rows` group-major rows (G = `group_size` consecutive rows per prompt): the
    factor by which `completion_log_probs` cuts the prompt's work; 1: each row runs its own.

    Slice i of n holds rows i, i + n, ..., so when n divides G it holds G / n rows of every
    prompt, consecutive. Besides algo.share_prompts, sharing takes the XLA attention (the
    shared forward's masks are dense; the cuDNN / Splash kernels take one padded sequence
    per row) and a prompt count per slice that the `batch_shards` devices holding the rows
    divide (else the largest divisor of G / n that gives one: no device idles).
    """
    if (not cfg.share_prompts or model_config.attention_impl != "xla" or group_size % slices
            or rows % slices):
        return 1
    group, per_slice = group_size // slices, rows // slices
    return next((d for d in range(group, 1, -1) if group % d == 0 and per_slice % d == 0
                 and (per_slice // d) % batch_shards == 0), 1)


def completion_hidden(model: nnx.Module, batch: UpdateBatch, prompt_group: int = 1, *,
                      router_stats: bool = False) -> tuple[jax.Array, ...]:
    """(hidden_BxCxE,): `model`'s final hidden states at the C positions that predict the
    completion tokens (`prompt_group`: see `completion_log_probs`); with `router_stats`
    (a mixture of experts), (hidden_BxCxE, router_stats_2xX) of the rows."""
    c = batch["loss_mask_BxC"].shape[1]
    ids_BxT, mask_BxT = batch["ids_BxT"], batch["mask_BxT"]
    # The hidden state at position t predicts token t + 1: completion token i is predicted
    # at P - 1 + i.
    if prompt_group > 1:
        p, g = ids_BxT.shape[1] - c, prompt_group
        prompt_NxPxE, completion_BxCxE, *stats = model.hidden_states_shared_prompt(
            ids_BxT[::g, :p], mask_BxT[::g, :p], ids_BxT[:, p:], mask_BxT[:, p:],
            router_stats=router_stats)
        return (jnp.concatenate([jnp.repeat(prompt_NxPxE[:, -1:], g, axis=0),
                                 completion_BxCxE[:, :-1]], axis=1), *stats)
    out = model.hidden_states(ids_BxT, mask_BxT, router_stats=router_stats)
    hidden_BxTxE, *stats = out if router_stats else (out,)
    return (hidden_BxTxE[:, -c - 1:-1], *stats)


def completion_outputs(modules: tuple[nnx.Module, ...], batch: UpdateBatch, per_token, *,
                       prompt_group: int = 1, budgets: tuple[int, ...] = (),
                       packed_rows: int | None = None, router_stats: bool = False) -> tuple:
    """(outputs, *router statistics): `per_token(modules, hidden_XxYxE, targets_XxY)`, a
    pytree of per-position [X, Y, ...] arrays of the hidden states of `modules[0]` (the trunk)
    and the tokens they predict, taken where the completion tokens are predicted: [B, C, ...].

    Padded (no `budgets`, no `packed_rows`): `completion_hidden`, the rows as they are
    (`prompt_group`: each prompt once for its rows). `packed_rows` R: the rows' real tokens
    end to end in R rows (`jaxrl.step.packing`; they must fit), `per_token` on every packed
    position, then gathered back. `budgets`: packed at the smallest that holds the rows, else
    padded, picked at run time by `lax.switch` (every branch compiled; the modules enter each
    branch as operands). Forward only: a switch under differentiation carries the residuals
    of every branch, so the updates switch around their whole value_and_grad instead
    (`jaxrl.step.updates.apply_updates`) and pass `packed_rows`.
    """
    c = batch["loss_mask_BxC"].shape[1]

    def padded(mods):
        hidden_BxCxE, *stats = completion_hidden(mods[0], batch, prompt_group,
                                                 router_stats=router_stats)
        return (per_token(mods, hidden_BxCxE, batch["ids_BxT"][:, -c:]), *stats)

    def packed(mods, rows):
        plan = packing.plan_rows(batch["mask_BxT"], c)
        ids_RxL, positions_RxL, segments_RxL, targets_RxL = packing.packed_inputs(
            batch["ids_BxT"], batch["mask_BxT"], plan, rows)
        out = mods[0].hidden_states_packed(ids_RxL, positions_RxL, segments_RxL,
                                           router_stats=router_stats)
        hidden_RxLxE, *stats = out if router_stats else (out,)
        outputs = per_token(mods, hidden_RxLxE, targets_RxL)
        return (jax.tree.map(lambda y: packing.unpack(y, plan), outputs), *stats)

    if packed_rows is not None:
        return packed(modules, packed_rows)
    if not budgets:
        return padded(modules)
    graphdef, state = nnx.split(modules)

    def branch(rows):
        def run(state):
            mods = nnx.merge(graphdef, state, copy=True)
            return padded(mods) if rows is None else packed(mods, rows)
        return run

    index = packing.branch(packing.plan_rows(batch["mask_BxT"], c), budgets)
    return jax.lax.switch(index, [branch(r) for r in (*budgets, None)], state)


def log_probs(model: nnx.Module, hidden_XxYxE: jax.Array, targets_XxY: jax.Array,
              temperature: float, chunk_size: int | str | None = None, *,
              unroll: bool = False) -> tuple[jax.Array, jax.Array]:
    """(logp_XxY, entropy_XxY) of `targets` under `model`'s projection of `hidden` at
    temperature T. With `chunk_size` ("auto": `resolve_logprob_chunk`) the projection runs in
    chunks of that many vocabulary columns (`chunked_log_probs_and_entropy`), so [X, Y, V]
    logits never exist at once; `unroll` unrolls that chunk loop (FLOP accounting: XLA's cost
    analysis counts a loop body once)."""
    chunk_size = resolve_logprob_chunk(chunk_size, model.config.vocab_size)
    if chunk_size is not None:
        return chunked_log_probs_and_entropy(
            hidden_XxYxE, model.output_embedding(), targets_XxY, temperature=temperature,
            chunk_size=chunk_size, unroll=unroll)
    logits_XxYxV = constrain(dense(hidden_XxYxE, model.output_embedding(), "bce,ev->bcv",
                                   jnp.float32), ("batch", "seq", "act_vocab"))
    return (token_log_probs(logits_XxYxV, targets_XxY, temperature),
            token_entropy(logits_XxYxV, temperature))


def completion_log_probs(model: nnx.Module, batch: UpdateBatch, temperature: float,
                         chunk_size: int | str | None = None, *, unroll: bool = False,
                         prompt_group: int = 1, budgets: tuple[int, ...] = (),
                         ) -> tuple[jax.Array, jax.Array]:
    """(logp_BxC, entropy_BxC) of the completion tokens under `model` given their prefix.

    Only the positions that predict completion tokens are projected onto the vocabulary
    (`log_probs`; packed, every packed position). With `prompt_group` g > 1 (`prompt_group()`),
    rows b·g ... b·g + g - 1 share their prompt and it runs once for them
    (`Transformer.hidden_states_shared_prompt`); `budgets`: see `completion_outputs`.
    """
    def per_token(mods, hidden, targets):
        return log_probs(mods[0], hidden, targets, temperature, chunk_size, unroll=unroll)

    return completion_outputs((model,), batch, per_token, prompt_group=prompt_group,
                              budgets=budgets)[0]


def completion_values(critic: nnx.Module, batch: UpdateBatch, policy: nnx.Module,
                      prompt_group: int = 1, budgets: tuple[int, ...] = (),
                      packed_rows: int | None = None) -> jax.Array:
    """values_BxC of the completion's states (`jaxrl.step.value_model.Critic`): the critic's
    head on its own trunk's hidden states or, a value head, on the policy's (`budgets`,
    `packed_rows`: see `completion_outputs`)."""
    trunk = policy if critic.trunk is None else critic.trunk
    return completion_outputs((trunk, critic.head), batch, lambda mods, h, t: mods[1](h),
                              prompt_group=prompt_group, budgets=budgets,
                              packed_rows=packed_rows)[0]


def split_rows(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B / n, ...], slice i holding rows i, i + n, i + 2n, ... (strided)."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


def unsplit_rows(x: jax.Array) -> jax.Array:
    """The inverse of `split_rows`."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def microbatching(cfg: AlgoSection, model_config, group_size: int, batch: UpdateBatch,
                  ) -> tuple[int, int, tuple[int, ...]]:
    """(microbatches of the whole batch, `prompt_group`, packed row budgets): how the
    trainer's forwards cut `batch` (`update_batch`'s arrays); budgets () when packing is off
    or never pays (`jaxrl.step.packing.budgets`)."""
    rows, c = batch["loss_mask_BxC"].shape
    micro_rows = cfg.microbatch_size or cfg.batch_split(rows)[0]
    total_micro = rows // micro_rows
    active = active_rules()
    shards = 1 if active is None else active[1].size("batch", active[0])
    group = prompt_group(cfg, model_config, group_size, rows, total_micro, shards)
    budgets = () if not cfg.packing else packing.budgets(
        micro_rows, batch["ids_BxT"].shape[1], c, group, shards)
    return total_micro, group, budgets


def packing_metrics(mask_BxT: jax.Array, num_micro: int, completion_len: int,
                    budgets: tuple[int, ...]) -> dict[str, jax.Array]:
    """train/real_token_frac: the batch's real (prompt + completion) tokens over rows x width;
    train/run_row_frac: the rows the trainer's forwards ran (packed or padded) over the rows;
    train/packed_frac: the microbatches that ran packed."""
    masks_NxBxT = split_rows(mask_BxT, num_micro)
    rows = masks_NxBxT.shape[1]
    options = jnp.asarray((*budgets, rows), jnp.float32)
    branch_N = jax.vmap(lambda m: packing.branch(packing.plan_rows(m, completion_len),
                                                 budgets))(masks_NxBxT)
    return {"train/real_token_frac": jnp.mean(mask_BxT, dtype=jnp.float32),
            "train/run_row_frac": jnp.mean(options[branch_N]) / rows,
            "train/packed_frac": jnp.mean(branch_N < len(budgets), dtype=jnp.float32)}
