"""The `serve` section: what `jaxrl serve` (JetStream's server over jaxrl's engine) runs with.

Sampling (`serve.sampling`: temperature / top-k / top-p, the sampler's own `SamplingParams`)
is the server's, not training's `rollout.sampling`: a policy trained at temperature 1 is often
served greedy. The KV pool's page size and the attention path come from `rollout.engine`
(the same engine); the stop tokens from `rollout`
(`rollout.stop_token_ids`, `rollout.ignore_eos`).
"""

from __future__ import annotations

import dataclasses

from jaxrl.config_base import fail, require_at_least
from jaxrl.rollout.settings import SamplingParams


@dataclasses.dataclass(frozen=True)
class ServeSection:
    """`serve`: address, slots, request limits and sampling of `jaxrl serve`."""

    host: str = "0.0.0.0"
    port: int = 9000  # 0: any free port (printed)
    # Decode slots (requests decoded at once), split over the rollout layout's batch axes
    # (jaxrl.rollout.slots_on_mesh); null: as many as fit in memory_fraction of a device
    # beside the weights (jaxrl.rollout.serving.slots_that_fit, at most 512) times those
    # axes' devices.
    max_slots: int | None = None
    memory_fraction: float = 0.9
    max_prefill_length: int = 512  # the longest prompt, in tokens; longer ones are refused
    max_new_tokens: int = 256  # the most a request may ask for (its max_tokens)
    chat_template: bool = True  # render text prompts with the tokenizer's chat template
    seed: int = 0  # request i of the server's life samples with fold_in(key(seed), i)
    drain_timeout_s: float = 60.0  # SIGTERM/SIGINT: how long requests in flight may finish
    warmup: bool = True  # compile every program before printing the address
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)

    def __post_init__(self):
        require_at_least("serve", self, ("port",), 0)
        require_at_least("serve", self, ("max_slots",), 1, " or null")
        require_at_least("serve", self, ("max_prefill_length", "max_new_tokens"))
        if self.port > 65535:
            fail("serve", self, "port", "a TCP port in [0, 65535]")
        if not 0 < self.memory_fraction <= 1:
            fail("serve", self, "memory_fraction", "in (0, 1]")
        if not self.drain_timeout_s >= 0:
            fail("serve", self, "drain_timeout_s", ">= 0 seconds")

    def prefill_buckets(self) -> tuple[int, ...]:
        """The padded prompt lengths (one compiled prefill each): powers of two from 16 below
        `max_prefill_length`, then it."""
        buckets = [n for n in (2 ** k for k in range(4, 32)) if n < self.max_prefill_length]
        return (*buckets, self.max_prefill_length)
