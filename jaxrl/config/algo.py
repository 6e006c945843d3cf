"""The `algo` and `optim` sections: what one RL step computes and how it updates the policy.

    algo   advantage estimator (gae: PPO with a learned critic, `algo.critic`), policy loss (`jaxrl.rl.PolicyLossConfig`, the loss's own
           parameters), updates per step (iterations x minibatches, microbatches), fused or
           split programs, log-prob chunking, DAPO's overlong buffer
    optim  AdamW on a warmup + cosine schedule with global-norm clipping (`jaxrl.step.optimizer`)

Both can be built in Python as well as from YAML, so they check their own types and choices.
The trainer's temperature is `rollout.sampling.temperature` (one field: the distribution the tokens
were sampled from).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

from jaxrl.config.critic import CriticSection
from jaxrl.config_base import fail, require_at_least
from jaxrl.rl.loss_config import PolicyLossConfig
from jaxrl.rl.settings import ScaleRewards

AdvantageEstimator = Literal["grpo", "rloo", "dr_grpo", "gae"]
StepMode = Literal["fused", "split", "async"]


def _require_int(section: str, obj: object, names: tuple[str, ...], optional: bool) -> None:
    for name in names:
        value = getattr(obj, name)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            fail(section, obj, name, "an integer" + (" or None" if optional else ""))


def resolve_logprob_chunk(chunk: int | str | None, vocab_size: int) -> int | None:
    """Vocabulary columns per log-prob chunk (None: whole logits), "auto" resolved; a chunk of
    the whole vocabulary or more is whole logits.

    "auto" is whole logits up to 16,384 columns and chunks of 16,384 above (a 150K
    vocabulary's [rows, completion, vocab] logits do not fit; the shipped 1.5B/3B configs),
    on every platform: whole logits train faster where they fit (`benchmarks/logprobs.py`;
    the numbers are in benchmarks/README.md); a per-platform choice, once measured on
    GPU/TPU, would go here."""
    if chunk == "auto":
        chunk = 16_384
    return None if chunk is None or chunk >= vocab_size else chunk


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """`algo`: advantages, loss and update schedule of one RL step."""

    advantage: AdvantageEstimator = "grpo"
    scale_rewards: ScaleRewards = "group"  # GRPO only
    loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    num_iterations: int = 1  # passes over the rollout batch
    num_minibatches: int = 1  # optimizer updates per pass; must divide the rows
    microbatch_size: int | None = None  # rows per gradient accumulation step; None: minibatch
    mask_zero_std_groups: bool = False  # drop groups whose rewards are all equal from the loss
    # The entropy bonus (loss.entropy_coef) falls linearly to 0 over entropy_decay_steps steps
    # from step entropy_decay_start on (None: constant): explore early, then commit.
    entropy_decay_start: int | None = None
    entropy_decay_steps: int = 1
    mode: StepMode = "fused"
    # async only: a batch is trained on at most this many updates after the weights that
    # generated it (jaxrl.step.asynchronous; 0: the synchronous algorithm on two sub-meshes).
    max_staleness: int = 1
    # Vocabulary columns per chunk of the completion log-probs; None: whole logits; "auto":
    # `resolve_logprob_chunk`.
    logprob_chunk_size: int | str | None = "auto"
    overlong_buffer: int | None = None  # DAPO soft overlong punishment zone (tokens); None: off
    # The trainer's forward runs each prompt once for the rows of its group that share a
    # microbatch instead of once per row (`jaxrl.step.forward.prompt_group`: same numbers).
    share_prompts: bool = True
    # The trainer's forwards and backwards run each microbatch packed (its rows' real tokens
    # end to end in fewer rows, `jaxrl.step.packing`) when that is fewer positions than
    # padded: work follows the tokens. Same numbers; false: always padded.
    packing: bool = True
    # Weight of the mixture-of-experts load-balancing loss (`jaxrl.models.moe`) added to the
    # policy loss, metric loss/router_aux; 0 (the default) skips it. transformers' default
    # `router_aux_loss_coef` is 0.001, but it only applies it with output_router_logits
    # (off by default): RL fine-tuning of a balanced pretrained router usually leaves it off.
    router_aux_coef: float = 0.0
    # advantage=gae: the critic (value model) and GAE's parameters (`jaxrl.config.critic`).
    critic: CriticSection = dataclasses.field(default_factory=CriticSection)

    def __post_init__(self):
        for name, choices in (("advantage", AdvantageEstimator), ("mode", StepMode),
                              ("scale_rewards", ScaleRewards)):
            if getattr(self, name) not in typing.get_args(choices):
                fail("algo", self, name, f"one of {typing.get_args(choices)}")
        if not isinstance(self.critic, CriticSection):
            fail("algo", self, "critic", "a CriticSection")
        if self.advantage == "gae" and self.mode == "async":
            fail("algo", self, "advantage", "'grpo', 'rloo' or 'dr_grpo' with algo.mode=async "
                 "(the critic runs only in the fused and split steps)")
        if not isinstance(self.loss, PolicyLossConfig):
            fail("algo", self, "loss", "a PolicyLossConfig")
        _require_int("algo", self, ("num_iterations", "num_minibatches", "entropy_decay_steps",
                                    "max_staleness"), optional=False)
        _require_int("algo", self, ("microbatch_size", "overlong_buffer",
                                    "entropy_decay_start"), optional=True)
        if self.logprob_chunk_size != "auto":
            if isinstance(self.logprob_chunk_size, str):
                fail("algo", self, "logprob_chunk_size", "an integer, None or 'auto'")
            _require_int("algo", self, ("logprob_chunk_size",), optional=True)
            require_at_least("algo", self, ("logprob_chunk_size",))
        require_at_least("algo", self, ("num_iterations", "num_minibatches", "microbatch_size",
                                        "overlong_buffer", "entropy_decay_steps"))
        require_at_least("algo", self, ("entropy_decay_start", "max_staleness"), 0)
        if self.entropy_decay_start is not None and not self.loss.entropy_coef > 0:
            fail("algo", self, "entropy_decay_start",
                 "None when algo.loss.entropy_coef is 0 (there is no bonus to decay)")
        if self.entropy_decay_start is not None and self.loss.entropy_target is not None:
            fail("algo", self, "entropy_decay_start",
                 "None when algo.loss.entropy_target sets an adaptive coefficient")
        if (isinstance(self.router_aux_coef, bool)
                or not isinstance(self.router_aux_coef, (int, float))
                or not math.isfinite(self.router_aux_coef) or self.router_aux_coef < 0):
            fail("algo", self, "router_aux_coef", "a finite number >= 0")
        for name in ("mask_zero_std_groups", "share_prompts", "packing"):
            if not isinstance(getattr(self, name), bool):
                fail("algo", self, name, "a bool")

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates of one RL step: num_iterations x num_minibatches."""
        return self.num_iterations * self.num_minibatches

    @property
    def single_update(self) -> bool:
        """One optimizer update per step: the old policy is the one being updated."""
        return self.updates_per_step == 1

    def batch_split(self, rows: int) -> tuple[int, int]:
        """(rows per minibatch, microbatches per minibatch) for a batch of `rows`."""
        if rows % self.num_minibatches:
            raise ValueError(f"algo.num_minibatches={self.num_minibatches} must divide the "
                             f"{rows} rows of the batch")
        minibatch = rows // self.num_minibatches
        micro = self.microbatch_size or minibatch
        if minibatch % micro:
            raise ValueError(f"algo.microbatch_size={self.microbatch_size} must divide the "
                             f"{minibatch} rows of a minibatch")
        return minibatch, minibatch // micro


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """`optim`: peak rate, warmup + cosine schedule, AdamW and clipping."""

    lr: float = 1e-6  # peak learning rate
    warmup_steps: int = 0  # linear warmup from 0 to lr
    total_steps: int | None = None  # end of the cosine decay (counting warmup); None: constant
    min_lr_ratio: float = 0.0  # the cosine's floor, as a fraction of lr
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled; weight matrices only
    max_grad_norm: float | None = 1.0  # global-norm clipping; None: off

    def __post_init__(self):
        _require_int("optim", self, ("warmup_steps", "total_steps"), optional=True)
        # `not x > 0` also rejects NaN.
        if not (self.lr > 0 and math.isfinite(self.lr)):
            fail("optim", self, "lr", "a finite number > 0")
        require_at_least("optim", self, ("warmup_steps",), 0)
        if self.total_steps is not None and not self.total_steps > self.warmup_steps:
            fail("optim", self, "total_steps", f"None or > warmup_steps ({self.warmup_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            fail("optim", self, "min_lr_ratio", "in [0, 1]")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                fail("optim", self, name, "in [0, 1)")
        if not self.eps > 0:
            fail("optim", self, "eps", "> 0")
        if not self.weight_decay >= 0:
            fail("optim", self, "weight_decay", ">= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            fail("optim", self, "max_grad_norm", "None or > 0")
