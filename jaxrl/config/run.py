"""The sections around the step: `train` (run directory, length, seed, saving), `log` and
`perf` (what a device is measured against); `distributed` is `jaxrl.distributed.settings`'s."""

from __future__ import annotations

import dataclasses

from jaxrl.config_base import fail, require_at_least


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """`train`: where the run goes, how long, the seed, saving."""

    run_dir: str | None = None  # null: runs/<config name>-<date-time>
    max_steps: int = 100
    seed: int = 0
    target_reward: float | None = None  # report when the 20-step mean reward first reaches it
    save_final: bool = True  # save the trained policy (HF format) to <run_dir>/final_model
    # <run_dir>/checkpoints (orbax, asynchronous): every N steps and at the end; 0: none (a run
    # without checkpoints cannot resume). `jaxrl train` on a run dir that has some resumes.
    checkpoint_every: int = 100
    keep_checkpoints: int = 3  # the newest N are kept
    # Stop when this many steps in a row skipped an update for a non-finite loss or gradient.
    max_skipped_in_a_row: int = 5
    # A step fails its rewards when some reward failed (raised, returned a non-number or a
    # value outside its bounds: the sample got 0) on more than this fraction of the step's
    # samples (data.batch_size x rollout.num_generations); 0: any failure, 1: never.
    reward_error_frac: float = 0.5
    # Stop, naming the reward's first error, after this many such steps in a row.
    reward_error_steps: int = 3

    def __post_init__(self):
        require_at_least("train", self, ("max_steps", "keep_checkpoints", "max_skipped_in_a_row",
                                         "reward_error_steps"))
        if not 0.0 <= self.reward_error_frac <= 1.0:
            fail("train", self, "reward_error_frac", "in [0, 1] (1: never stop)")
        require_at_least("train", self, ("seed",), 0)
        require_at_least("train", self, ("checkpoint_every",), 0, " (0: no checkpoints)")


@dataclasses.dataclass(frozen=True)
class LogSection:
    """`log`: what besides metrics.jsonl the run writes, and how often it prints."""

    tensorboard: bool = True  # <run_dir>/tensorboard, besides metrics.jsonl (always written)
    plot: bool = True  # <run_dir>/reward.png at the end
    print_every: int = 50  # a progress line every N steps when stderr is not a terminal

    def __post_init__(self):
        require_at_least("log", self, ("print_every",))


@dataclasses.dataclass(frozen=True)
class PerfSection:
    """`perf`: the FLOP/s and memory a device is measured against (MFU, the memory fit)."""

    peak_tflops: float | None = None  # per device; null: table by device kind, measured on CPU
    memory_limit_gib: float | None = None  # per device; null: the device's own memory
    count_flops: bool = True  # compile the phase programs to count FLOPs (perf/mfu, perf/hfu)
    # Host stamps in the step program (time/generate_s, time/train_s). null: on GPU/TPU, off
    # on CPU, where a program with a host callback runs synchronously: the host can no longer
    # log step N-1 while step N runs (the CPU quickstart is slower). `jaxrl bench`
    # always stamps (it waits for every step anyway).
    phase_times: bool | None = None

    def __post_init__(self):
        for name in ("peak_tflops", "memory_limit_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                fail("perf", self, name, "> 0 or null")
