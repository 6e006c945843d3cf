"""`jaxrl check`: build a model on the mesh, print where every parameter lives, run a forward.

A smoke job for a new machine or a new layout. Without `model.path` it builds a tiny random
model of `check.family`, writes it as an HF directory and loads it back (so the real loading
code runs), then checks that a jitted forward over a left-padded, batch-sharded input gives
finite logits equal to the unsharded model's.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from jaxrl.config import Family, ModelSection, ShardingSection, require_at_least
from jaxrl.models import Transformer, load_policy, save_pretrained
from jaxrl.models.config import tiny_config
from jaxrl.sharding import create_sharded, make_mesh, resolve_layout, use_rules
from jaxrl.sharding.rules import variable_axes

SINGLE_DEVICE_COMPARE_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class CheckSection:
    family: Family = "qwen2"  # architecture of the tiny model built when model.path is unset
    batch_size: int = 8
    seq_len: int = 16
    seed: int = 0

    def __post_init__(self):
        require_at_least("check", self, ("batch_size", "seq_len"))


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    sharding: ShardingSection = dataclasses.field(default_factory=ShardingSection)
    check: CheckSection = dataclasses.field(default_factory=CheckSection)


def run_check(cfg: CheckConfig, console: Console) -> dict[str, Any]:
    """Runs the smoke job, printing as it goes; returns a summary with `ok`."""
    layout = resolve_layout(cfg.sharding.layout)
    mesh = make_mesh(layout)
    devices = jax.devices()
    console.print(f"[bold]devices[/]: {len(devices)} x {devices[0].device_kind} "
                  f"({jax.default_backend()}), {jax.process_count()} process(es)")
    console.print(f"[bold]layout[/] {layout.name}: mesh {dict(mesh.shape)}")

    rules, load = layout.train_rules, cfg.model.load_settings()
    if cfg.model.path:
        model = load_policy(cfg.model.path, load, mesh=mesh, rules=rules)
        source = cfg.model.path
    else:
        model_cfg = tiny_config(
            cfg.check.family, param_dtype=load.dtype or "float32",
            compute_dtype=load.compute_dtype or load.dtype or "float32",
            scan_layers=load.scan_layers, attention_impl=load.attention_impl, remat=load.remat)
        built = create_sharded(lambda: Transformer(model_cfg, rngs=nnx.Rngs(cfg.check.seed)),
                               mesh, rules)
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(built, tmp)  # reloaded in the dtypes it was made in
            model = load_policy(tmp, load, mesh=mesh, rules=rules)
        source = f"tiny random {cfg.check.family} (saved as HF and reloaded)"
    console.print(f"[bold]model[/]: {source}, {model.config.num_params():,} parameters")
    console.print(_layout_table(model, mesh, layout))

    ids_BxT, mask_BxT = _sample_batch(model.config, cfg.check)
    batch_sharding = rules.sharding(("batch", "seq"), ids_BxT.shape, mesh)
    ids_BxT, mask_BxT = (jax.device_put(a, batch_sharding) for a in (ids_BxT, mask_BxT))

    @nnx.jit
    def forward(model, ids_BxT, mask_BxT):
        with use_rules(mesh, rules):
            return model(ids_BxT, attention_mask=mask_BxT)

    start = time.perf_counter()
    logits = jax.block_until_ready(forward(model, ids_BxT, mask_BxT))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    logits = jax.block_until_ready(forward(model, ids_BxT, mask_BxT))
    run_s = time.perf_counter() - start

    finite = bool(np.isfinite(np.asarray(logits)).all())
    max_diff = None
    param_bytes = model.config.num_params() * jnp.dtype(model.config.param_dtype).itemsize
    if param_bytes <= SINGLE_DEVICE_COMPARE_BYTES:
        reference = _unsharded_logits(model, np.asarray(ids_BxT), np.asarray(mask_BxT))
        valid = np.asarray(mask_BxT).astype(bool)
        max_diff = float(np.max(np.abs(np.asarray(logits)[valid] - reference[valid])))
        scale = float(np.max(np.abs(reference[valid])))
        tolerance = 1e-4 if model.config.compute_dtype == "float32" else 2e-2
        agreement = (f"max |sharded - single device| = {max_diff:.2e} "
                     f"(bound {tolerance:.0e} x {scale:.2f})")
        ok = finite and max_diff <= tolerance * scale
    else:
        agreement = "single-device comparison skipped (the model is over 1 GiB)"
        ok = finite
    console.print(
        f"[bold]forward[/]: logits {tuple(logits.shape)} sharded {logits.sharding.spec}, "
        f"compile+run {compile_s:.2f}s, run {run_s * 1e3:.1f} ms; finite={finite}; {agreement}")
    console.print("[bold green]check passed[/]" if ok else "[bold red]check FAILED[/]")
    return {"ok": ok, "mesh": dict(mesh.shape), "num_params": model.config.num_params(),
            "max_abs_diff": max_diff, "compile_s": compile_s, "run_s": run_s}


def _layout_table(model: Transformer, mesh, layout) -> Table:
    table = Table(title="parameters (layers.* stands for each layer): "
                        "logical axes -> mesh axes (train | rollout)")
    for column in ("parameter", "shape", "dtype", "logical axes", "train", "rollout", "MiB/device"):
        table.add_column(column)
    seen = set()
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        # Layers share one layout: show layer 0 as `layers.*`.
        name = ".".join("*" if isinstance(part, int) else str(part) for part in path)
        if name in seen:
            continue
        seen.add(name)
        axes = variable_axes(variable)
        value = variable[...]
        shard_bytes = max(s.data.nbytes for s in value.addressable_shards)
        table.add_row(
            name, str(tuple(value.shape)), str(value.dtype), str(tuple(axes)),
            str(tuple(layout.train_rules.spec(axes, value.shape, mesh))),
            str(tuple(layout.rollout_rules.spec(axes, value.shape, mesh))),
            f"{shard_bytes / 2**20:.3f}")
    return table


def _sample_batch(config, check: CheckSection) -> tuple[np.ndarray, np.ndarray]:
    """Random ids, every other row left-padded to about half length."""
    rng = np.random.default_rng(check.seed)
    ids_BxT = rng.integers(0, config.vocab_size, (check.batch_size, check.seq_len), np.int32)
    mask_BxT = np.ones_like(ids_BxT, bool)
    mask_BxT[1::2, : check.seq_len // 2] = False
    return np.where(mask_BxT, ids_BxT, 0), mask_BxT


def _unsharded_logits(model: Transformer, ids_BxT: np.ndarray, mask_BxT: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(model)
    device = jax.devices()[0]
    local = nnx.merge(graphdef, jax.device_put(state, device))
    return np.asarray(nnx.jit(lambda m, i, a: m(i, attention_mask=a))(
        local, jax.device_put(ids_BxT, device), jax.device_put(mask_BxT, device)))
