"""A random `model.init` policy for a run without `model.path`: made in the train layout for
the task's tokenizer, saved with it in HF format (then loaded back through the same code as
any model directory); refused before anything is made when it cannot fit the devices."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from transformers import PreTrainedTokenizerBase

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.distributed import is_main, sync
from jaxrl.models import ModelConfig, Transformer, save_pretrained
from jaxrl.models.families import attention_switches
from jaxrl.models.layers import INIT_STD
from jaxrl.perf import device_memory, format_bytes
from jaxrl.sharding import Layout, create_sharded


def _init_moe(init) -> dict[str, int | bool]:
    """The mixture-of-experts fields of a random `model.init` policy (qwen3_moe only)."""
    if init.family != "qwen3_moe":
        return {}
    return dict(num_experts=init.num_experts, num_experts_per_tok=init.num_experts_per_tok,
                moe_intermediate_size=init.moe_intermediate_size,
                norm_topk_prob=init.norm_topk_prob)


def init_model(cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase, path: Path,
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
        max_position_embeddings=cfg.data.max_prompt_len + cfg.rollout.completion_budget,
        tie_word_embeddings=init.tie_word_embeddings, rope_theta=init.rope_theta,
        **attention_switches(init.family), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, param_dtype=dtype,
        compute_dtype=cfg.model.compute_dtype or dtype, **_init_moe(init))
    _check_init_fits(cfg, config, mesh)
    model = create_sharded(lambda: Transformer(config, rngs=nnx.Rngs(cfg.train.seed)), mesh,
                           layout.train_rules)
    if init.embed_std != INIT_STD:  # drawn at INIT_STD: the same draw, rescaled
        model.embed[...] = model.embed[...] * (init.embed_std / INIT_STD)
    return save_hf(model, tokenizer, path)


def _check_init_fits(cfg: ExperimentConfig, config: ModelConfig, mesh: Mesh) -> None:
    """Refuses a `model.init` whose parameters and Adam moments (3 copies) cannot fit the
    devices' memory even spread evenly, before any is made: XLA aborts the process on arrays
    that large instead of raising, and making them layer by layer could take hours. (What the
    step needs, against perf.memory_limit_gib too, is the compiled step's check.)"""
    try:
        limit, source = device_memory(mesh.local_devices[0])
    except ValueError:
        return  # unknown memory: the compiled step's check decides later
    need = 3 * config.num_params() * jnp.dtype(config.param_dtype).itemsize
    if need > limit * mesh.size:
        raise ConfigError(
            f"model.init makes a policy of {config.num_params():,} parameters "
            f"(hidden_size={config.hidden_size}, intermediate_size={config.intermediate_size}, "
            f"num_layers={config.num_layers}): with Adam's two moments that is "
            f"{format_bytes(need)}, more than the {format_bytes(limit * mesh.size)} of all "
            f"{mesh.size} devices ({source}); choose a smaller model.init")


def save_hf(model: nnx.Module, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """`model` and `tokenizer` as an HF directory at `path`: every process gathers the
    weights, process 0 writes, all wait until it has."""
    save_pretrained(model, path)
    if is_main():
        tokenizer.save_pretrained(str(path))
    sync(f"jaxrl: saved {path}")
    return path
