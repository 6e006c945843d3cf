"""The experiment config of `jaxrl train`: one frozen dataclass per section.

    model     which policy: a local HF directory, or (path: null) a random one of `model.init`
    sharding  the layout preset (mesh shape + rule sets)
    rollout   sampling: group size, completion budget, temperature / top-k / top-p
    algo      what one RL step computes (`StepConfig`: advantages, loss, updates, fused/split)
    optim     AdamW, schedule, clipping (`OptimConfig`)
    data      the task (prompts + verifier rewards) and how prompts are batched
    train     run directory, steps, seed, the final evaluation
    log       TensorBoard, the reward plot, progress lines
    perf      peak FLOP/s and memory limit overrides, FLOP counting on/off

`load_config(ExperimentConfig, path, overrides)` fills it from YAML and dotted overrides; every
section validates itself in `__post_init__`, so a bad value fails before anything compiles.
"""

from __future__ import annotations

import dataclasses
import typing

from jaxrl.config import Family, ModelSection, RolloutSection, ShardingSection
from jaxrl.data.tasks.registry import SYNTHETIC_TASKS, TaskName
from jaxrl.train.optimizer import OptimConfig
from jaxrl.train.phases import StepConfig


def _fail(section: str, obj: object, name: str, requirement: str) -> typing.NoReturn:
    raise ValueError(f"{section}.{name} must be {requirement}, got {getattr(obj, name)!r}")


@dataclasses.dataclass(frozen=True)
class InitSection:
    """A random policy made from scratch (used when `model.path` is null): sizes and family."""

    family: Family = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 10_000.0
    vocab_size: int | None = None  # null: the tokenizer's; larger: extra rows (benchmarks)

    def __post_init__(self):
        if not self.rope_theta > 0:
            _fail("model.init", self, "rope_theta", "> 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            _fail("model.init", self, "vocab_size", ">= 1 or null")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads"):
            if getattr(self, name) < 1:
                _fail("model.init", self, name, ">= 1")
        if self.hidden_size % self.num_heads:
            _fail("model.init", self, "hidden_size",
                  f"a multiple of num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            _fail("model.init", self, "num_heads",
                  f"a multiple of num_kv_heads={self.num_kv_heads}")


@dataclasses.dataclass(frozen=True)
class TrainModelSection(ModelSection):
    """`model`: the policy's directory and dtypes, and `init` for a random one (path null)."""

    init: InitSection = dataclasses.field(default_factory=InitSection)


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Which task (prompt rendering + verifier rewards) and where its prompts come from."""

    task: TaskName = "addition"
    source: str | None = None  # a .jsonl/.json/.parquet file; null: the task makes its own
    prompt_column: str = "prompt"  # gsm8k: the question column
    answer_column: str = "answer"
    chat_template: bool = True  # render prompts with the tokenizer's template if it has one
    max_prompt_len: int = 256  # longer prompts are dropped (and counted), never truncated
    batch_size: int = 32  # prompts per step (x rollout.num_generations samples)
    num_digits: int = 2  # addition: operand digits
    num_prompts: int = 20_000  # synthetic tasks: prompts generated for training
    format_weight: float = 0.0  # gsm8k: weight of the \boxed{} format reward (0: off)

    def __post_init__(self):
        for name in ("max_prompt_len", "batch_size", "num_prompts"):
            if getattr(self, name) < 1:
                _fail("data", self, name, ">= 1")
        if not 1 <= self.num_digits <= 18:
            _fail("data", self, "num_digits", "in [1, 18]")
        if self.task in SYNTHETIC_TASKS and self.source is not None:
            raise ValueError(f"data.source must be null for data.task={self.task} (it makes its "
                             f"own prompts), got {self.source!r}; set data.task for a file")
        if self.task not in SYNTHETIC_TASKS and not self.source:
            raise ValueError(f"data.source must name a .jsonl/.json/.parquet file of questions "
                             f"and answers for data.task={self.task}, got {self.source!r}")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """`train`: where the run goes, how long, the seed, the final evaluation, saving."""

    run_dir: str | None = None  # null: runs/<config name>-<date-time>
    max_steps: int = 100
    seed: int = 0
    eval_prompts: int = 1000  # fresh prompts for the greedy evaluation at the end (0: none)
    eval_batch_size: int = 250
    target_reward: float | None = None  # report when the 20-step mean reward first reaches it
    save_final: bool = True  # save the trained policy (HF format) to <run_dir>/final_model

    def __post_init__(self):
        if self.max_steps < 1:
            _fail("train", self, "max_steps", ">= 1")
        if self.seed < 0:
            _fail("train", self, "seed", ">= 0")
        if self.eval_prompts < 0:
            _fail("train", self, "eval_prompts", ">= 0")
        if self.eval_batch_size < 1:
            _fail("train", self, "eval_batch_size", ">= 1")


@dataclasses.dataclass(frozen=True)
class LogSection:
    """`log`: what besides metrics.jsonl the run writes, and how often it prints."""

    tensorboard: bool = True  # <run_dir>/tensorboard, besides metrics.jsonl (always written)
    plot: bool = True  # <run_dir>/reward.png at the end
    print_every: int = 50  # a progress line every N steps when stderr is not a terminal

    def __post_init__(self):
        if self.print_every < 1:
            _fail("log", self, "print_every", ">= 1")


@dataclasses.dataclass(frozen=True)
class PerfSection:
    """`perf`: the FLOP/s and memory a device is measured against (MFU, the memory fit)."""

    peak_tflops: float | None = None  # per device; null: table by device kind, measured on CPU
    memory_limit_gib: float | None = None  # per device; null: the device's own memory
    count_flops: bool = True  # compile the phase programs to count FLOPs (perf/mfu, perf/hfu)
    # Host stamps in the step program (time/generate_s, time/train_s). null: on GPU/TPU, off
    # on CPU, where a program with a host callback runs synchronously: the host can no longer
    # log step N-1 while step N runs (measured: ~20% slower CPU quickstart). `jaxrl bench`
    # always stamps (it waits for every step anyway).
    phase_times: bool | None = None

    def __post_init__(self):
        for name in ("peak_tflops", "memory_limit_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                _fail("perf", self, name, "> 0 or null")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment (module docstring); checks that span sections."""

    model: TrainModelSection = dataclasses.field(default_factory=TrainModelSection)
    sharding: ShardingSection = dataclasses.field(default_factory=ShardingSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    algo: StepConfig = dataclasses.field(default_factory=StepConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    perf: PerfSection = dataclasses.field(default_factory=PerfSection)

    def __post_init__(self):
        if self.algo.advantage in ("grpo", "rloo") and self.rollout.num_generations < 2:
            raise ValueError(f"rollout.num_generations must be >= 2 for algo.advantage="
                             f"{self.algo.advantage} (a group baseline needs two samples), "
                             f"got {self.rollout.num_generations}")
        buffer = self.algo.overlong_buffer
        if buffer is not None and buffer > self.rollout.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer={buffer} must be at most "
                             f"rollout.max_new_tokens={self.rollout.max_new_tokens} (the soft "
                             f"zone lies inside the completion budget)")
        if self.algo.temperature != self.rollout.temperature:
            raise ValueError(f"algo.temperature={self.algo.temperature} must equal "
                             f"rollout.temperature={self.rollout.temperature}: the trainer "
                             f"scores each token under the distribution it was sampled from")
        rows = self.data.batch_size * self.rollout.num_generations
        try:
            self.algo.batch_split(rows)
        except ValueError as e:
            raise ValueError(f"{e} (the batch has data.batch_size x rollout.num_generations = "
                             f"{rows} rows)") from None
