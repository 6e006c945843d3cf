"""Everything a training run needs, built from its config: `build_run(cfg, run_dir, console)`.

    mesh        from the layout preset (train and rollout rule sets); algo.mode=async splits
                the devices: `mesh` trains, `rollout_mesh` generates (its own layout)
    tokenizer   the model directory's, or the task's own (synthetic tasks)
    policy      `model.path` loaded straight into the train layout; with `model.path: null`
                a random `model.init` policy is made, saved with the tokenizer in HF format
                to <run_dir>/init_model and loaded back through the same code
    task        prompt rows, verifier rewards, the fields they read
    batches     tokenized, left-padded prompt batches (drops over-long prompts, counted),
                which prompts each step takes chosen by `data.curriculum`
    plan        how the step is assembled (`jaxrl.config.plan`), decided once from the config,
                the environment and the rewards, before the weights load: a combination
                that cannot run is refused within seconds; the run keeps it (`Run.plan`)
                and everything that depends on the mode asks it
    step        the learner with the plan's rollout source (`build_step`: in-graph, jitted,
                queued on the rollout mesh, or multi-turn episodes) over a donated train state

Nothing here runs a step; a bad value (a missing column, a prompt set that does not fit)
fails here, before anything compiles.

Several processes: each builds the same run; process 0 alone writes files (the random
policy). Every process tokenizes the whole prompt set and draws the same batch positions each
step (so the curriculum stays in step), but takes and places only the rows its devices hold
(`process_rows` of the batch sharding); Python rewards then score those rows in each process
(split mode).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.config.algo import resolve_logprob_chunk
from jaxrl.config.plan import RunPlan, plan, splits_devices
from jaxrl.data.curriculum import LAG, make_prompt_sampler
from jaxrl.data.prompts import PromptBatch, PromptBatches
from jaxrl.data.tasks.registry import Task, make_task
from jaxrl.data.tokenizer import completion_end_ids, load_tokenizer, pad_token_id, rollout_end_ids
from jaxrl.distributed import broadcast
from jaxrl.models import ModelConfig, Transformer, load_policy
from jaxrl.models.hf_io import read_config
from jaxrl.models.lora import adapter_params
from jaxrl.perf import format_bytes, memory_limit
from jaxrl.rl import RewardSet
from jaxrl.rollout import Sampler, SamplerConfig
from jaxrl.run.episodes import (
    env_rewards,
    env_spec,
    make_episodes,
    task_prompts,
)
from jaxrl.run.init_policy import init_model, save_hf
from jaxrl.run.placement import Placed, Placement
from jaxrl.saved.files import INIT_MODEL_DIR
from jaxrl.sharding import Layout, make_mesh, resolve_layout
from jaxrl.sharding.layout import LayoutError
from jaxrl.sharding.submeshes import split_devices
from jaxrl.step.asynchronous import QueuedRollouts
from jaxrl.step.builder import Step, build_step
from jaxrl.step.multiturn import Episodes
from jaxrl.step.state import reference_params, train_state_from_model


@dataclasses.dataclass(frozen=True)
class Run:
    """The built pieces of a run (module docstring); the train state travels beside it."""

    cfg: ExperimentConfig
    run_dir: Path
    mesh: Mesh
    layout: Layout
    tokenizer: PreTrainedTokenizerBase
    task: Task
    model_config: ModelConfig
    batches: PromptBatches
    placement: Placement
    plan: RunPlan
    step: Step
    ref_params: nnx.State | None  # the frozen KL reference (algo.loss.beta > 0), else None
    rollout_mesh: Mesh | None = None  # algo.mode=async: the generating devices (`mesh` trains)
    episodes: Episodes | None = None  # multi-turn: the environments answering the turns

    @property
    def queue(self) -> QueuedRollouts | None:
        """The batches made ahead of training (`plan.keeps_queue`: async), else None."""
        return self.step.source if self.plan.keeps_queue else None

    @property
    def num_devices(self) -> int:
        """Devices the step runs on (both meshes in async mode)."""
        return self.mesh.size + (self.rollout_mesh.size if self.rollout_mesh is not None else 0)

    @property
    def rows(self) -> int:
        """Samples per step: prompts x generations."""
        return self.cfg.data.batch_size * self.cfg.rollout.num_generations

    def place(self, batch: PromptBatch) -> Placed:
        """A step's batch as the step's device arguments."""
        return self.placement.place(batch, self.cfg.data.batch_size)


def policy(step: Step, state: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the policy model inside a train `state` (not a copy: do not
    donate it)."""
    return nnx.split(nnx.merge(step.graphdef, state).model)


def save_policy(run: Run, state: nnx.State, path: Path) -> Path:
    """The policy in `state` and the run's tokenizer as an HF model directory at `path`
    (written by process 0; every process takes part in gathering the weights)."""
    return save_hf(nnx.merge(run.step.graphdef, state).model, run.tokenizer, path)


def build_run(cfg: ExperimentConfig, run_dir: Path, console: Console, *,
              reuse_init: bool = False) -> tuple[Run, nnx.State]:
    """(the run, its initial train state): mesh, tokenizer, policy, task, prompt batches and
    step (module docstring).

    `reuse_init`: the run directory belongs to this experiment already (a resumed run,
    `jaxrl eval`): a random policy it saved before is loaded instead of made again.
    """
    try:
        task = make_task(cfg.data, seed=cfg.train.seed)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data: {e}") from None
    spec = env_spec(cfg, task)  # multi-turn: the environment answering the turns
    layout, mesh, rollout_layout, rollout_mesh = _meshes(cfg)
    model_path = _model_path(cfg, run_dir, task, mesh, layout, console, reuse_init)
    try:
        tokenizer = load_tokenizer(model_path)
    except FileNotFoundError as e:
        raise ConfigError(f"model.path: {e}") from None
    rewards = task.reward_set(tokenizer, task.train_rows)
    if spec is not None:
        rewards = dataclasses.replace(rewards, rewards=[*rewards.rewards,
                                                        *env_rewards(spec, task)])
    # Decided once, before the weights load and the prompts are tokenized, so a combination
    # that cannot run is refused first: the fused program's reward callback would run on one
    # process over the whole batch, and one compiled program cannot wait for environments.
    run_plan = plan(cfg, env=spec, python_rewards=bool(rewards.python_rewards),
                    processes=jax.process_count())
    if run_plan.describe() is not None:
        console.print(run_plan.describe())
    model = _load_policy(cfg, model_path, mesh, layout)
    _describe(cfg, model, mesh, layout, rollout_mesh, rollout_layout, console)
    batches, placement = _prompt_batches(cfg, run_plan, task, tokenizer, mesh, layout, console)
    ts = train_state_from_model(
        model, cfg.optim, mesh, layout.train_rules,
        critic=cfg.algo.critic if cfg.algo.advantage == "gae" else None,
        adaptive_entropy_coef=(cfg.algo.loss.entropy_coef
                               if cfg.algo.loss.entropy_target is not None else None))
    ref_params = reference_params(ts) if cfg.algo.loss.beta > 0 else None
    graphdef, state = nnx.split(ts)
    episodes = None if run_plan.env is None else make_episodes(
        cfg, run_plan.env, task, tokenizer, completion_end_ids(tokenizer, model.config, ()),
        model.config.vocab_size)
    step = _step(cfg, run_plan, graphdef, nnx.graphdef(ts.model), model.config, tokenizer,
                 rewards, episodes, (mesh, layout), (rollout_mesh, rollout_layout))
    run = Run(cfg, run_dir, mesh, layout, tokenizer, task, model.config, batches, placement,
              run_plan, step, ref_params, rollout_mesh, episodes)
    return run, state


def _model_path(cfg: ExperimentConfig, run_dir: Path, task: Task, mesh: Mesh, layout: Layout,
                console: Console, reuse_init: bool) -> Path:
    """The policy's HF directory: `model.path`, or a random `model.init` policy saved with
    the task's tokenizer to <run_dir>/init_model first (module docstring)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    if task.tokenizer is None:
        raise ConfigError(f"data.task={task.name} brings no tokenizer or model: set "
                          f"model.path to a local HF model directory")
    model_path = run_dir / INIT_MODEL_DIR
    if not (reuse_init and broadcast((model_path / "config.json").is_file())):
        init_model(cfg, task.tokenizer(), model_path, mesh, layout)
        console.print(f"[bold]policy[/]: random {cfg.model.init.family} saved to {model_path}")
    return model_path


def _load_policy(cfg: ExperimentConfig, model_path: Path, mesh: Mesh, layout: Layout
                 ) -> Transformer:
    """The policy loaded from `model_path` straight into the train layout."""
    if cfg.model.lora is not None:
        _check_lora_fits(cfg, model_path, mesh)
    return load_policy(model_path, cfg.model.load_settings(), mesh=mesh, rules=layout.train_rules)


def _describe(cfg: ExperimentConfig, model: Transformer, mesh: Mesh, layout: Layout,
              rollout_mesh: Mesh | None, rollout_layout: Layout, console: Console) -> None:
    """Prints the policy's shape and mesh, its LoRA adapters, how async splits the devices."""
    model_config = model.config
    processes = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
    console.print(f"[bold]policy[/]: {model_config.model_type}, "
                  f"{model_config.num_params():,} parameters ({model_config.param_dtype}, "
                  f"compute {model_config.compute_dtype}); mesh {dict(mesh.shape)}{processes}, "
                  f"layout {layout.name}")
    if model_config.lora is not None:
        lora = model_config.lora
        adapters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
        console.print(f"[bold]LoRA[/]: rank {lora.rank}, alpha {lora.alpha:g} on "
                      f"{', '.join(lora.targets)}: {adapters:,} trainable parameters "
                      f"({adapters / model_config.num_params():.2%}; the base is frozen), "
                      f"rollout {lora.rollout}")
    if rollout_mesh is None:
        return
    console.print(f"[bold]async[/]: {rollout_mesh.size} rollout devices (mesh "
                  f"{dict(rollout_mesh.shape)}, layout {rollout_layout.name}) and "
                  f"{mesh.size} train devices; batches trained at most "
                  f"{cfg.algo.max_staleness} updates after the weights that made them"
                  + ("; in-flight weight updates (each batch generated in "
                     f"{cfg.algo.max_staleness} pieces, each with the newest weights)"
                     if cfg.rollout.inflight_updates else ""))
    if cfg.algo.max_staleness > 0 and not cfg.algo.loss.uses_sampler_logp:
        console.print("[yellow]async[/]: no off-policy correction (algo.loss.correction="
                      "tis without tis_cap): stale batches are trained as if on-policy; "
                      "set algo.loss.tis_cap (e.g. 2.0) or algo.loss.correction=decoupled")


def _prompt_batches(cfg: ExperimentConfig, run_plan: RunPlan, task: Task,
                    tokenizer: PreTrainedTokenizerBase, mesh: Mesh, layout: Layout,
                    console: Console
                    ) -> tuple[PromptBatches, Placement]:
    """The tokenized prompt batches (the curriculum choosing each step's prompts, this
    process's rows taken) and how a batch is placed on the mesh."""
    try:
        batches = task_prompts(cfg, task, task.train_rows, run_plan.env,
                               batch_size=cfg.data.batch_size,
                               seed=cfg.train.seed).build(tokenizer)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data: {e}") from None
    try:
        difficulty_N = None
        if cfg.data.curriculum == "ordered":
            column = task.train_rows[task.difficulty_column]
            difficulty_N = np.asarray(column, np.float64)[batches.rows_N]
        batches.use_sampler(make_prompt_sampler(
            cfg.data.curriculum, batches.num_prompts, batches.batch_size, batches.seed,
            difficulty_N=difficulty_N, group_size=cfg.rollout.num_generations,
            # Async mode draws batches max_staleness steps before their turn.
            lag=LAG + run_plan.max_staleness))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data.curriculum={cfg.data.curriculum}: {e}") from None
    placement = Placement(mesh, layout.train_rules, task, tokenizer)
    # Each process draws the whole batch's positions and keeps the rows its devices hold.
    batches.use_rows(placement.process_rows(cfg.data.batch_size))
    stats = batches.stats
    console.print(f"[bold]data[/]: task {task.name}, {stats.num_prompts:,} prompts "
                  f"({stats.num_dropped:,} of {stats.num_rows:,} dropped as longer than "
                  f"data.max_prompt_len={cfg.data.max_prompt_len}; longest kept "
                  f"{stats.longest} tokens)")
    return batches, placement


def _step(cfg: ExperimentConfig, run_plan: RunPlan, graphdef: nnx.GraphDef,
          model_graphdef: nnx.GraphDef, model_config: ModelConfig,
          tokenizer: PreTrainedTokenizerBase, rewards: RewardSet, episodes: Episodes | None,
          train: tuple[Mesh, Layout], rollout: tuple[Mesh | None, Layout]) -> Step:
    """The run's step: the learner, with the rollout source of the run's plan."""
    (mesh, layout), (rollout_mesh, rollout_layout) = train, rollout
    sampler_config = SamplerConfig.of(
        cfg.rollout, end_token_ids=rollout_end_ids(tokenizer, model_config, cfg.rollout),
        pad_token_id=pad_token_id(tokenizer))
    sampler = Sampler(model_graphdef, sampler_config, mesh=rollout_mesh or mesh,
                      rules=rollout_layout.rollout_rules)
    algo = dataclasses.replace(cfg.algo, logprob_chunk_size=resolve_logprob_chunk(
        cfg.algo.logprob_chunk_size, model_config.vocab_size))
    return build_step(
        algo, graphdef, sampler, rewards, plan=run_plan, optim=cfg.optim, mesh=mesh,
        rules=layout.train_rules,
        rollout=None if rollout_mesh is None else (rollout_mesh, rollout_layout.rollout_rules),
        episodes=episodes, env_rewards=any(r.name == "env" for r in rewards.rewards),
        phase_times=_phase_times(cfg, mesh))


def _meshes(cfg: ExperimentConfig) -> tuple[Layout, Mesh, Layout, Mesh | None]:
    """(train layout, train mesh, rollout layout, rollout mesh): one mesh over every device
    (the rollout mesh None), or in async mode the devices split by sharding.rollout_devices,
    each side laid out by its own preset (`auto` resolved for its own device count)."""
    section = cfg.sharding
    if not splits_devices(cfg):
        layout = resolve_layout(section.layout)
        return layout, make_mesh(layout), layout, None
    if jax.device_count() < 2:
        raise ConfigError(f"algo.mode=async needs at least 2 devices (a rollout side and a "
                          f"train side), found {jax.device_count()}; use algo.mode=fused")
    try:
        rollout_devices, train_devices = split_devices(section.rollout_share)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    layout = resolve_layout(section.layout, len(train_devices))
    try:
        rollout_layout = resolve_layout(section.rollout_layout or section.layout,
                                        len(rollout_devices))
    except (FileNotFoundError, LayoutError) as e:
        raise ConfigError(f"sharding.rollout_layout={section.rollout_layout}: {e}") from None
    return (layout, make_mesh(layout, train_devices), rollout_layout,
            make_mesh(rollout_layout, rollout_devices))


def _check_lora_fits(cfg: ExperimentConfig, model_path: Path, mesh: Mesh) -> None:
    """Refuses LoRA adapters that, with the frozen base and Adam's two moments of the
    adapters, cannot fit the devices' memory (perf.memory_limit_gib, else the devices') even
    spread evenly, before any is drawn: loading draws them in one program, so an oversized
    rank would end in the OOM killer, not an error. (What the step needs is the compiled
    step's check.)"""
    lora = cfg.model.lora
    try:
        config = read_config(model_path, dtype=cfg.model.dtype)
        limit, source = memory_limit(cfg.perf.memory_limit_gib, mesh.local_devices[0])
    except (ValueError, OSError):
        return  # an unreadable model is from_pretrained's to report; unknown memory: later
    item = jnp.dtype(config.param_dtype).itemsize
    base, per_rank = config.num_params() * item, 3 * adapter_params(config, lora) // lora.rank
    need = base + lora.rank * per_rank * item
    if need > limit * mesh.size:
        fit = max(0, (limit * mesh.size - base) // (per_rank * item))
        raise ConfigError(
            f"model.lora.rank={lora.rank:,} gives {adapter_params(config, lora):,} adapter "
            f"parameters on {', '.join(lora.targets)}: with Adam's two moments and the frozen "
            f"base that is {format_bytes(need)}, more than the {format_bytes(limit * mesh.size)} "
            f"of the run's {mesh.size} device(s) ({source}); "
            + (f"at most rank {fit:,} fits" if fit else "no rank fits beside the base")
            + "; choose a smaller model.lora.rank (8-64 is usual)")


def _phase_times(cfg: ExperimentConfig, mesh: Mesh) -> bool:
    """perf.phase_times, or by default: stamps on accelerators, none on CPU (PerfSection.phase_times)."""
    if cfg.perf.phase_times is not None:
        return cfg.perf.phase_times
    return mesh.devices.flat[0].platform != "cpu"
