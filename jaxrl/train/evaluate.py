"""Greedy evaluation of the policy on held-out prompts of a synthetic task.

    rows   = task.eval_rows(n, seed)          held-out problems, never training rows
    tokens = greedy completions (temperature 0, one per prompt), same compiled sampler code
    r_B    = the task's rewards (weights as in training)

Reported: `eval/reward_mean` (mean total reward), `eval/exact_match` (fraction of prompts
whose every reward is 1, i.e. solved: for addition, every digit and the EOS right) and
`eval/num_prompts`. Prompts go in fixed-size batches (the last one padded with repeats of
its first prompt, whose results are dropped), so one program serves every batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxrl.data.prompts import PromptSource
from jaxrl.data.tokenizer import stop_token_ids
from jaxrl.rl import RewardInputs
from jaxrl.rollout import Sampler, SamplingParams

if TYPE_CHECKING:
    from jaxrl.train.run import Run

__all__ = ["evaluate"]


def evaluate(run: Run, num_prompts: int, batch_size: int, *, seed: int) -> dict[str, float]:
    """Greedy mean reward and exact match of `run`'s policy on `num_prompts` held-out prompts
    (fewer when the task holds out fewer)."""
    cfg = run.cfg
    rows = run.task.eval_rows(num_prompts, seed)
    prompts = PromptSource(rows, prompt_column="prompt", field_columns=run.task.field_columns,
                           chat_template=cfg.data.chat_template,
                           max_prompt_len=cfg.data.max_prompt_len,
                           batch_size=1, seed=seed).build(run.tokenizer)
    ids_NxP, mask_NxP, rows_N = prompts.ids_NxP, prompts.mask_NxP, prompts.rows_N
    n = len(ids_NxP)
    rewards = run.task.reward_set(run.tokenizer, rows)
    max_total = sum(r.weight for r in rewards.rewards)
    # Evaluation measures task accuracy, where stopping (at EOS) is part of the answer:
    # rollout.ignore_eos, a training-throughput setting, does not apply here.
    config = dataclasses.replace(
        run.sampler.config, num_generations=1, sampling=SamplingParams(temperature=0.0),
        stop_token_ids=stop_token_ids(run.tokenizer, run.model_config, cfg.rollout.stop_token_ids))
    graphdef, params = run.policy()
    sampler = Sampler(graphdef, config, mesh=run.mesh, rules=run.layout.rollout_rules)
    score = jax.jit(rewards.score)
    batch_size = min(batch_size, n)
    totals = []
    for start in range(0, n, batch_size):
        take_B = np.arange(start, start + batch_size)
        take_B = np.where(take_B < n, take_B, start)  # pad the last batch with its first row
        fields = {c: [prompts.fields[c][i] for i in take_B] for c in run.task.field_columns}
        prompts_B, fields_B, rows_B = run.place_rows(
            ids_NxP[take_B], mask_NxP[take_B], rows_N[take_B],
            run.task.device_fields(run.tokenizer, fields))
        rollout = sampler.generate(params, prompts_B, jax.random.key(seed))
        inputs = RewardInputs(rollout.prompt_ids_BxP, rollout.prompt_mask_BxP,
                              rollout.completion_ids_BxC, rollout.completion_mask_BxC,
                              fields_B, rows_B)
        total_B, _ = score(inputs)
        totals.append(np.asarray(total_B)[:min(batch_size, n - start)])
    total_N = np.concatenate(totals)
    return {"eval/reward_mean": float(total_N.mean()),
            "eval/exact_match": float(np.mean(total_N >= max_total - 1e-6)),
            "eval/num_prompts": float(n)}
