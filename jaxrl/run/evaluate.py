"""Evaluation of the policy on held-out prompts: n samples each, reward, exact match, pass@k.

    rows     = task.eval_rows(eval.num_prompts, eval.seed)   held-out, never training rows
    samples  = eval.num_samples completions per prompt, drawn with eval.sampling.temperature /
               top_k / top_p (temperature 0: greedy, n = 1) by the same compiled sampler code
    r_pj     = Σ_k w_k · r_k,pj, the task's rewards of sample j of prompt p (weights as in
               training); the sample is *solved* when r_pj is the highest total a sample can
               earn (`RewardSet.solved`; addition: every digit and the EOS right)
    c_p      = solved samples of prompt p, out of n   (arrays: N prompts x S = n samples)

Reported (each call of an `Evaluator`):

    eval/reward_mean   mean of r_pj over all samples
    eval/exact_match   fraction of samples solved
    eval/pass@k        for each k in eval.k, the unbiased estimator (Chen et al. 2021)
                           pass@k = mean_p [1 - C(n - c_p, k) / C(n, k)]
                       computed as 1 - Π_{i=n-c_p+1..n} (1 - k/i): no huge binomials
    eval/num_prompts   N (fewer than eval.num_prompts when the task holds out fewer)
    eval/num_samples   n

Greedy with n = 1 (the default) makes pass@1 = exact_match. Prompts go in fixed-size
batches (the last one padded with repeats of its first prompt, whose results are dropped), so
one program serves every batch. Prompt i samples with key fold_in(key(eval.seed), i): results
do not depend on eval.batch_size, and every evaluation of a run draws the same keys, so
differences between evaluations are the policy's. Evaluation measures task accuracy, where
stopping at EOS is part of the answer: `rollout.ignore_eos`, a throughput setting, does not
apply here.

`Evaluator(run, cfg)` builds the prompts and the sampler once (periodic evaluation compiles
once); each call `evaluator(params)` evaluates the policy with those parameters.
`append_eval` adds {"step": s, **metrics} to <run_dir>/eval.jsonl, the record of every
evaluation of a run (training's and `jaxrl eval`'s).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import EvalSection
from jaxrl.data.tokenizer import completion_end_ids
from jaxrl.rollout import Rollout, Sampler, SamplerConfig
from jaxrl.run.episodes import RowView, task_prompts
from jaxrl.saved.files import EVAL_FILE
from jaxrl.sharding import AxisRules
from jaxrl.step.builder import score_host_rows
from jaxrl.step.multiturn import run_episodes
from jaxrl.step.phases import reward_inputs

if TYPE_CHECKING:
    from jaxrl.run.build import Run

__all__ = ["Evaluator", "append_eval", "pass_at_k"]


def pass_at_k(c_N: np.ndarray, n: int, k: int) -> np.ndarray:
    """Per prompt, 1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn
    without replacement, hold a solved one (c solved), as 1 - Π_{i=n-c+1..n} (1 - k/i)."""
    c_N = np.asarray(c_N)
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs k in [1, n={n}], got k={k}")
    if c_N.size and not (c_N.min() >= 0 and c_N.max() <= n):
        raise ValueError(f"solved counts must lie in [0, n={n}], got {c_N.min()}..{c_N.max()}")
    i_I = np.arange(1, n + 1)
    factors_NxI = np.where(i_I > n - c_N[:, None], 1.0 - k / i_I, 1.0)
    # With fewer than k unsolved samples every k-subset holds a solved one (some factor
    # would be <= 0 there).
    return np.where(n - c_N < k, 1.0, 1.0 - np.prod(factors_NxI, axis=1))


@functools.lru_cache(maxsize=4)
def _sampler(graphdef: nnx.GraphDef, config: SamplerConfig, mesh: Mesh,
             rules: AxisRules) -> Sampler:
    # A Sampler compiles once per prompt shape: the evaluations of a run (every N steps, at
    # the end) share one instead of compiling the decode loop each time.
    return Sampler(graphdef, config, mesh=mesh, rules=rules)


@jax.jit
def _prompt_keys(key: jax.Array, index_B: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index_B)


class Evaluator:
    """Held-out prompts and a sampler for `run`'s policy; each call evaluates the policy
    parameters it is given."""

    def __init__(self, run: Run, cfg: EvalSection):
        if cfg.num_prompts < 1:
            raise ValueError(f"eval.num_prompts must be >= 1 to evaluate, got {cfg.num_prompts}")
        task = run.task
        if task.eval_rows is None:
            raise ValueError(f"data.task={task.name} has no held-out prompts to evaluate on")
        self.cfg, self.placement = cfg, run.placement
        rows = task.eval_rows(cfg.num_prompts, cfg.seed)
        self.prompts = task_prompts(run.cfg, task, rows, run.plan.env, batch_size=1,
                                    seed=cfg.seed).build(run.tokenizer)
        self.rewards = rewards = task.reward_set(run.tokenizer, rows)
        n = cfg.num_samples
        config = dataclasses.replace(
            run.step.sampler.config, num_generations=n, sampling=cfg.sampling,
            end_token_ids=completion_end_ids(run.tokenizer, run.model_config,
                                         run.cfg.rollout.stop_token_ids))
        self.sampler = _sampler(run.step.sampler.graphdef, config, run.mesh,
                                run.layout.rollout_rules)
        self._episodes = None
        if run.episodes is not None:  # the same environments, on held-out rows
            episodes = run.episodes
            slots = min(episodes.config.num_slots, cfg.batch_size * n)
            self._episodes = dataclasses.replace(
                episodes, rows=RowView(rows),
                config=dataclasses.replace(episodes.config, num_slots=slots))

        def score(rollout: Rollout, fields_B: dict[str, jax.Array], rows_B: jax.Array):
            return rewards.score(reward_inputs(rollout, fields_B, rows_B, n))[0]

        # Replicated: every process reads all the totals (they are few).
        replicated = NamedSharding(run.mesh, PartitionSpec())
        self._score = jax.jit(score, out_shardings=replicated)
        self._host_rows = None
        if rewards.python_rewards and jax.process_count() > 1:
            # As in training: each process scores its own rows with the Python rewards
            # (in the program, one callback would score them all on process 0).
            self._inputs = jax.jit(lambda rollout, fields_B, rows_B: reward_inputs(
                rollout, fields_B, rows_B, n))
            self._total = jax.jit(lambda inputs, host_values: rewards.score(
                inputs, host_values)[0], out_shardings=replicated)
            self._host_rows = functools.partial(score_host_rows, rewards, mesh=run.mesh)

    def _multiturn(self, params, prompts_B, rows_B, keys_B) -> Rollout:
        model = nnx.merge(self.sampler.graphdef, params)
        return run_episodes(model, self._episodes, prompts_B, rows_B, keys_B,
                            self.cfg.sampling, self.cfg.num_samples,
                            mesh=self.sampler.mesh, rules=self.sampler.rules)[1]

    @property
    def num_prompts(self) -> int:
        """N: the held-out prompts kept (over-long ones are dropped)."""
        return len(self.prompts.ids_NxP)

    def __call__(self, params: nnx.State) -> dict[str, float]:
        """The metrics of the module docstring for the policy whose parameters are `params`
        (the model's state, as `jaxrl.run.build.policy` gives it)."""
        n, num = self.cfg.num_samples, self.num_prompts
        ids_NxP, mask_NxP, rows_N = self.prompts.ids_NxP, self.prompts.mask_NxP, self.prompts.rows_N
        key = jax.random.key(self.cfg.seed)
        batch = min(self.cfg.batch_size, num)
        totals = []
        for start in range(0, num, batch):
            take_B = np.arange(start, start + batch)
            take_B = np.where(take_B < num, take_B, start)  # pad with the batch's first row
            fields = {c: [values[i] for i in take_B] for c, values in self.prompts.fields.items()}
            prompts_B, fields_B, rows_B = self.placement.place_rows(
                ids_NxP[take_B], mask_NxP[take_B], rows_N[take_B], fields)
            if self._episodes is None:
                rollout = self.sampler.generate(params, prompts_B, _prompt_keys(key, take_B))
            else:
                rollout = self._multiturn(params, prompts_B, rows_B, _prompt_keys(key, take_B))
            if self._host_rows is None:
                total = self._score(rollout, fields_B, rows_B)
            else:
                inputs = self._inputs(rollout, fields_B, rows_B)
                total = self._total(inputs, self._host_rows(inputs))
            total_BxS = np.asarray(total).reshape(batch, n)
            totals.append(total_BxS[:min(batch, num - start)])
        total_NxS = np.concatenate(totals)
        c_N = np.sum(self.rewards.solved(total_NxS), axis=1)
        return {"eval/reward_mean": float(total_NxS.mean()),
                "eval/exact_match": float(c_N.sum() / total_NxS.size),
                **{f"eval/pass@{k}": float(pass_at_k(c_N, n, k).mean()) for k in self.cfg.k},
                "eval/num_prompts": float(num),
                "eval/num_samples": float(n)}


def append_eval(run_dir: Path, step: int | None, metrics: dict[str, float]) -> Path:
    """Appends {"step": step, **metrics} as one line to <run_dir>/eval.jsonl (step: training
    steps behind the policy, None when unknown)."""
    path = Path(run_dir) / EVAL_FILE
    if jax.process_index() == 0:  # one writer in a run of several processes
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
    return path
