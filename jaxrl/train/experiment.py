"""The experiment config of `jaxrl train`: one frozen dataclass per section.

    model     which policy: a local HF directory, or (path: null) a random one of `model.init`
    sharding  the layout preset (mesh shape + rule sets)
    rollout   sampling: group size, completion budget, temperature / top-k / top-p
    algo      what one RL step computes (`StepConfig`: advantages, loss, updates, fused/split)
    optim     AdamW, schedule, clipping (`OptimConfig`)
    data      the task (prompts + verifier rewards) and how prompts are batched
    train     run directory, steps, seed, saving
    eval      held-out evaluation: prompts, samples per prompt, pass@k, how often
    log       TensorBoard, the reward plot, progress lines
    perf      peak FLOP/s and memory limit overrides, FLOP counting on/off
    distributed  joining a run of several processes (hosts): coordinator, count, id

`load_config(ExperimentConfig, path, overrides)` fills it from YAML and dotted overrides; every
section validates itself in `__post_init__`, so a bad value fails before anything compiles.
"""

from __future__ import annotations

import dataclasses
import typing

from jaxrl.config import Family, ModelSection, RolloutSection, ShardingSection
from jaxrl.data.tasks.config import TaskConfig
from jaxrl.distributed.setup import DistributedSection
from jaxrl.rollout.sampling import SamplingParams
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
class DataSection(TaskConfig):
    """`data`: the task's keys (`TaskConfig`: which task, its rows, rewards and held-out rows)
    and how its prompts are tokenized, batched and chosen each step."""

    chat_template: bool = True  # render prompts with the tokenizer's template if it has one
    max_prompt_len: int = 256  # longer prompts are dropped (and counted), never truncated
    batch_size: int = 32  # prompts per step (x rollout.num_generations samples)
    curriculum: typing.Literal["none", "pass_rate", "ordered"] = "none"  # jaxrl.data.curriculum

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_prompt_len", "batch_size"):
            if getattr(self, name) < 1:
                _fail("data", self, name, ">= 1")
        if self.curriculum == "ordered" and self.difficulty_column is None:
            raise ValueError("data.curriculum=ordered goes from easy to hard: set "
                             "data.difficulty_column to a numeric column of the dataset")


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

    def __post_init__(self):
        if self.max_steps < 1:
            _fail("train", self, "max_steps", ">= 1")
        if self.seed < 0:
            _fail("train", self, "seed", ">= 0")
        if self.checkpoint_every < 0:
            _fail("train", self, "checkpoint_every", ">= 0 (0: no checkpoints)")
        for name in ("keep_checkpoints", "max_skipped_in_a_row"):
            if getattr(self, name) < 1:
                _fail("train", self, name, ">= 1")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """`eval`: held-out prompts, n samples each, scored by the task's rewards (evaluate.py).

    Training evaluates at the end (and every `every` steps); `jaxrl eval` on demand.
    """

    num_prompts: int = 1000  # held-out prompts (the task's eval rows); 0: no evaluation
    batch_size: int = 250  # prompts per sampler call (x num_samples completions)
    num_samples: int = 1  # completions per prompt (n of pass@k)
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    k: list[int] = dataclasses.field(default_factory=lambda: [1])  # eval/pass@k for each
    every: int = 0  # training evaluates every N steps too; 0: only at the end
    seed: int = 0  # which held-out prompts, and the sampling keys (the same at every eval)

    def __post_init__(self):
        if self.num_prompts < 0:
            _fail("eval", self, "num_prompts", ">= 0 (0: no evaluation)")
        for name in ("batch_size", "num_samples"):
            if getattr(self, name) < 1:
                _fail("eval", self, name, ">= 1")
        for name in ("every", "seed"):
            if getattr(self, name) < 0:
                _fail("eval", self, name, ">= 0")
        try:
            self.sampling_params()
        except ValueError as e:
            raise ValueError(f"eval.{e}") from None
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.num_samples={self.num_samples} needs eval.temperature > 0, "
                             f"got 0 (greedy samples of a prompt would all be identical)")
        if not self.k or len(set(self.k)) != len(self.k):
            _fail("eval", self, "k", "a non-empty list of distinct sample counts")
        if not all(1 <= k <= self.num_samples for k in self.k):
            _fail("eval", self, "k", f"a list of values in [1, eval.num_samples="
                                     f"{self.num_samples}]")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


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
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    perf: PerfSection = dataclasses.field(default_factory=PerfSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)

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
