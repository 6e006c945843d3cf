"""The experiment config of `jaxrl train`, `bench`, `eval` and `serve`: one frozen dataclass per section.

    model        which policy: a local HF directory, or (path: null) a random one of `model.init`
    sharding     the layout preset (mesh shape + rule sets), `auto` by default
    rollout      sampling: group size, completion budget, sampling (temperature / top-k /
                 top-p), the engine (slots, pages, batching)
    algo         what one RL step computes: advantages, loss, updates, fused/split
    optim        AdamW, schedule, clipping
    data         the task (prompts + verifier rewards) and how prompts are batched
    train        run directory, steps, seed, saving
    eval         held-out evaluation: prompts, samples per prompt, pass@k, how often
    serve        `jaxrl serve`: address, slots, request limits, the server's sampling
    log          TensorBoard, the reward plot, progress lines
    perf         peak FLOP/s and memory limit overrides, FLOP counting on/off
    distributed  joining a run of several processes (hosts): coordinator, count, id

`load_config(ExperimentConfig, path, overrides)` fills it from YAML and dotted overrides; every
section validates itself in `__post_init__` and `ExperimentConfig` checks what spans sections,
so a bad value fails before anything compiles.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config.algo import AlgoSection, OptimSection
from jaxrl.config.model import ShardingSection, TrainModelSection
from jaxrl.config.run import LogSection, PerfSection, TrainSection
from jaxrl.config.sampling import EvalSection, RolloutSection
from jaxrl.config.serve import ServeSection
from jaxrl.data.section import DataSection
from jaxrl.distributed.settings import DistributedSection
from jaxrl.rl.settings import check_group_size, check_overlong


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment (module docstring); checks that span sections."""

    model: TrainModelSection = dataclasses.field(default_factory=TrainModelSection)
    sharding: ShardingSection = dataclasses.field(default_factory=ShardingSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    serve: ServeSection = dataclasses.field(default_factory=ServeSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    perf: PerfSection = dataclasses.field(default_factory=PerfSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)

    def __post_init__(self):
        rollout, algo = self.rollout, self.algo
        try:  # every estimator and the zero-std masks compare samples within a group
            check_group_size(rollout.num_generations)
        except ValueError as e:
            raise ValueError(f"rollout.num_generations: {e} (algo.advantage="
                             f"{algo.advantage})") from None
        if algo.overlong_buffer is not None:
            try:  # the soft zone lies inside the completion budget
                check_overlong(rollout.max_new_tokens, algo.overlong_buffer)
            except ValueError as e:
                raise ValueError(f"algo.overlong_buffer={algo.overlong_buffer} with "
                                 f"rollout.max_new_tokens={rollout.max_new_tokens}: {e}") from None
        temperature = rollout.sampling.temperature
        if not temperature > 0:
            raise ValueError(f"rollout.sampling.temperature must be > 0 to train (the trainer "
                             f"scores each token under the distribution it was sampled from), "
                             f"got {temperature}")
        if algo.loss.uses_sampler_logp and temperature != 1.0:
            # The correction divides by the sampler's temperature-1 log-probs (logp_raw_BxC);
            # at another temperature the ratio would compare two different distributions.
            raise ValueError(f"algo.loss.correction={algo.loss.correction!r} with tis_cap="
                             f"{algo.loss.tis_cap} needs rollout.sampling.temperature=1.0 "
                             f"(the sampler's log-probs it corrects are at temperature 1), got "
                             f"{temperature}")
        if rollout.inflight_updates and (algo.mode != "async" or algo.max_staleness < 2):
            # A batch spans max_staleness steps from its first piece to its training; with
            # fewer than 2 no new weights arrive while it is generated.
            raise ValueError(f"rollout.inflight_updates=true needs algo.mode=async with "
                             f"algo.max_staleness >= 2 (new weights arrive while a batch is "
                             f"generated only then), got algo.mode={algo.mode}, "
                             f"algo.max_staleness={algo.max_staleness}")
        rows = self.data.batch_size * rollout.num_generations
        try:
            algo.batch_split(rows)
        except ValueError as e:
            raise ValueError(f"{e} (the batch has data.batch_size x rollout.num_generations = "
                             f"{rows} rows)") from None
