"""Everything a training run needs, built from its config: `build_run(cfg, run_dir, console)`.

    mesh        from the layout preset (train and rollout rule sets)
    tokenizer   the model directory's, or the task's own (synthetic tasks)
    policy      `model.path` loaded straight into the train layout; with `model.path: null`
                a random `model.init` policy is made, saved with the tokenizer in HF format
                to <run_dir>/init_model and loaded back through the same code
    task        prompt rows, verifier rewards, the fields they read
    batches     tokenized, left-padded prompt batches (drops over-long prompts, counted),
                which prompts each step takes chosen by `data.curriculum`
    step        the fused/split RL step program(s) over a donated train state

Nothing here runs a step; a bad value (a missing column, a prompt set that does not fit)
fails here, before anything compiles.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from jaxrl.config import ConfigError
from jaxrl.data.curriculum import make_prompt_sampler
from jaxrl.data.prompts import PromptBatch, PromptBatches, PromptSource
from jaxrl.data.tasks.registry import Task, make_task
from jaxrl.data.tokenizer import load_tokenizer, pad_token_id, stop_token_ids
from jaxrl.models import ModelConfig, Transformer, from_pretrained, save_pretrained
from jaxrl.rl import RewardSet
from jaxrl.rollout import Prompts, Sampler, SamplerConfig
from jaxrl.sharding import Layout, create_sharded, load_layout, make_mesh
from jaxrl.train.experiment import ExperimentConfig
from jaxrl.train.state import reference_params, train_state_from_model
from jaxrl.train.step import Step, build_step

INIT_MODEL_DIR = "init_model"


@dataclasses.dataclass
class Run:
    """The built pieces of a run; `state` is the TrainState's nnx.State (donated each step)."""

    run_dir: Path
    cfg: ExperimentConfig
    layout: Layout
    mesh: Mesh
    tokenizer: PreTrainedTokenizerBase
    task: Task
    model_config: ModelConfig
    batches: PromptBatches
    rewards: RewardSet
    sampler: Sampler
    step: Step
    graphdef: nnx.GraphDef
    state: nnx.State
    ref_params: nnx.State | None

    @property
    def rows(self) -> int:
        """Samples per step: prompts x generations."""
        return self.cfg.data.batch_size * self.cfg.rollout.num_generations

    def place(self, batch: PromptBatch) -> tuple[Prompts, dict[str, jax.Array], jax.Array]:
        """A host batch as the step's device arguments, split over the mesh's batch axes."""
        return self.place_rows(batch.ids_BxP, batch.mask_BxP, batch.rows_B,
                               self.task.device_fields(self.tokenizer, batch.fields))

    def place_rows(self, ids_BxP: np.ndarray, mask_BxP: np.ndarray, rows_B: np.ndarray,
                   fields_B: dict[str, np.ndarray],
                   ) -> tuple[Prompts, dict[str, jax.Array], jax.Array]:
        """Host arrays (one row per prompt) on the mesh, rows split over its batch axes."""
        rules = self.layout.train_rules

        def put(x):
            x = np.asarray(x)
            axes = ("batch",) + (None,) * (x.ndim - 1)
            return jax.device_put(x, rules.sharding(axes, x.shape, self.mesh))

        return (Prompts(put(ids_BxP), put(mask_BxP)), {k: put(v) for k, v in fields_B.items()},
                put(np.asarray(rows_B, np.int32)))

    def save_policy(self, path: Path) -> Path:
        """The current policy and its tokenizer as an HF model directory at `path`."""
        save_pretrained(nnx.merge(self.graphdef, self.state).model, path)
        self.tokenizer.save_pretrained(str(path))
        return path

    def policy(self) -> tuple[nnx.GraphDef, nnx.State]:
        """(graphdef, state) of the current policy model (not a copy: do not donate it)."""
        return nnx.split(nnx.merge(self.graphdef, self.state).model)


def build_run(cfg: ExperimentConfig, run_dir: Path, console: Console, *,
              reuse_init: bool = False) -> Run:
    """Builds mesh, tokenizer, policy, task, prompt batches and step (module docstring).

    `reuse_init`: the run directory belongs to this experiment already (a resumed run,
    `jaxrl eval`): a random policy it saved before is loaded instead of made again.
    """
    try:
        task = make_task(cfg.data, seed=cfg.train.seed)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data: {e}") from None
    layout = load_layout(cfg.sharding.layout)
    mesh = make_mesh(layout)
    model_path = cfg.model.path
    if model_path is None:
        if task.tokenizer is None:
            raise ConfigError(f"data.task={task.name} brings no tokenizer or model: set "
                              f"model.path to a local HF model directory")
        model_path = run_dir / INIT_MODEL_DIR
        if not (reuse_init and (model_path / "config.json").is_file()):
            _init_model(cfg, task.tokenizer(), model_path, mesh, layout)
            console.print(f"[bold]policy[/]: random {cfg.model.init.family} saved to "
                          f"{model_path}")
    tokenizer = load_tokenizer(model_path)
    model = from_pretrained(model_path, dtype=cfg.model.dtype,
                            compute_dtype=cfg.model.compute_dtype, mesh=mesh,
                            rules=layout.train_rules, scan_layers=cfg.model.scan_layers,
                            attention_impl=cfg.model.attention_impl, remat=cfg.model.remat)
    model_config = model.config
    console.print(f"[bold]policy[/]: {model_config.model_type}, "
                  f"{model_config.num_params():,} parameters ({model_config.param_dtype}, "
                  f"compute {model_config.compute_dtype}); mesh {dict(mesh.shape)}")

    try:
        batches = PromptSource(
            task.train_rows, prompt_column="prompt", field_columns=task.field_columns,
            chat_template=cfg.data.chat_template, max_prompt_len=cfg.data.max_prompt_len,
            batch_size=cfg.data.batch_size, seed=cfg.train.seed).build(tokenizer)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data: {e}") from None
    try:
        difficulty_N = None
        if cfg.data.curriculum == "ordered":
            column = task.train_rows[task.difficulty_column]
            difficulty_N = np.asarray(column, np.float64)[batches.rows_N]
        batches.use_sampler(make_prompt_sampler(
            cfg.data.curriculum, batches.num_prompts, batches.batch_size, batches.seed,
            difficulty_N=difficulty_N, group_size=cfg.rollout.num_generations))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data.curriculum={cfg.data.curriculum}: {e}") from None
    stats = batches.stats
    console.print(f"[bold]data[/]: task {task.name}, {stats.num_prompts:,} prompts "
                  f"({stats.num_dropped:,} of {stats.num_rows:,} dropped as longer than "
                  f"data.max_prompt_len={cfg.data.max_prompt_len}; longest kept "
                  f"{stats.longest} tokens)")

    rewards = task.reward_set(tokenizer, task.train_rows)
    ts = train_state_from_model(model, cfg.optim, mesh, layout.train_rules)
    sampler_config = SamplerConfig(
        max_new_tokens=cfg.rollout.max_new_tokens, num_generations=cfg.rollout.num_generations,
        stop_token_ids=() if cfg.rollout.ignore_eos else stop_token_ids(
            tokenizer, model_config, cfg.rollout.stop_token_ids),
        pad_token_id=pad_token_id(tokenizer), sampling=cfg.rollout.sampling_params())
    sampler = Sampler(nnx.graphdef(ts.model), sampler_config, mesh=mesh,
                      rules=layout.rollout_rules)
    ref_params = reference_params(ts) if cfg.algo.loss.beta > 0 else None
    graphdef, state = nnx.split(ts)
    step = build_step(cfg.algo, graphdef, sampler, rewards, optim=cfg.optim, mesh=mesh,
                      rules=layout.train_rules, phase_times=_phase_times(cfg, mesh))
    return Run(run_dir, cfg, layout, mesh, tokenizer, task, model_config, batches, rewards,
               sampler, step, graphdef, state, ref_params)


def _init_model(cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase, path: Path,
                mesh: Mesh, layout: Layout) -> Path:
    """A random `model.init` policy for `tokenizer`, saved with it in HF format at `path`."""
    init = cfg.model.init
    dtype = cfg.model.dtype or "float32"
    vocab_size = init.vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ConfigError(f"model.init.vocab_size={vocab_size} must be at least the "
                          f"tokenizer's {len(tokenizer)} tokens (or null)")
    config = ModelConfig(
        model_type=init.family, vocab_size=vocab_size, hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size, num_layers=init.num_layers,
        num_heads=init.num_heads, num_kv_heads=init.num_kv_heads,
        head_dim=init.hidden_size // init.num_heads,
        max_position_embeddings=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
        tie_word_embeddings=init.tie_word_embeddings, rope_theta=init.rope_theta,
        qkv_bias=init.family == "qwen2",
        qk_norm=init.family == "qwen3", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, param_dtype=dtype,
        compute_dtype=cfg.model.compute_dtype or dtype)
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(cfg.train.seed)), mesh,
                           layout.train_rules)
    save_pretrained(model, path)
    tokenizer.save_pretrained(str(path))
    return path


def _phase_times(cfg: ExperimentConfig, mesh: Mesh) -> bool:
    """perf.phase_times, or by default: stamps on accelerators, none on CPU (experiment.py)."""
    if cfg.perf.phase_times is not None:
        return cfg.perf.phase_times
    return mesh.devices.flat[0].platform != "cpu"
