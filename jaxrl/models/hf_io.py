"""Load and save HF checkpoints (`config.json` + safetensors) as sharded `Transformer`s.

Loading never materialises the model on one device: the model is built abstractly
(`nnx.eval_shape`), each parameter's sharding comes from the logical-axis rules, and each
array is assembled from per-device shards, each read from the memory-mapped safetensors file
as only the slice that its device holds (once for all devices that replicate it), converted
from the HF layout (`hf_names`) and put on its devices before the next slice is read. With
`scan_layers` a parameter stacks all layers, so a shard reads its slice from each of its
layers' tensors.

Saving is the inverse, one parameter at a time on the host, in the model's parameter dtype;
only process 0 writes. Shards are planned from the shapes before any gather, so at most one
shard's tensors are held on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models import hf_names
from jaxrl.models.attention_kernels import resolve_attention_impl
from jaxrl.models.config import AttentionImpl, ModelConfig, Remat, UnsupportedModelError
from jaxrl.models.load_settings import LoadSettings
from jaxrl.models.lora_merge import merged_params
from jaxrl.models.transformer import Transformer
from jaxrl.sharding.rules import AxisRules, state_shardings

HF_CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_LOAD = LoadSettings()  # the checkpoint's dtypes, no scan, auto attention, no remat
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


class CheckpointError(ValueError):
    """A model directory whose files cannot be read (truncated, corrupted) or whose tensors
    do not match the architecture its config.json describes."""


def load_policy(path: str | Path, load: LoadSettings = _DEFAULT_LOAD, *,
                mesh: Mesh | None = None, rules: AxisRules | None = None) -> Transformer:
    """Loads an HF model directory as `load` says, each tensor straight onto its sharding
    under `rules`.

    `load.dtype` (parameters) defaults to the checkpoint's `torch_dtype`, `compute_dtype` to
    `dtype`. Without a mesh the model lives unsharded on `jax.local_devices()[0]`.
    `attention_impl` is resolved for the platform of the mesh's devices (an impossible choice
    is a ValueError). With `load.lora` the model gets new adapters (A drawn from `lora.seed`,
    B = 0) on the loaded base.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    config_file = path / HF_CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no {HF_CONFIG_FILE} in {str(path)!r}: expected an HF model directory "
            f"({HF_CONFIG_FILE} plus {SINGLE_FILE} or {INDEX_FILE})")
    if mesh is not None and rules is None:
        raise ValueError("loading onto a mesh also needs rules= to place parameters, "
                         "e.g. rules=load_layout('fsdp').train_rules")
    param_dtype = None if load.dtype is None else _dtype_name(load.dtype)
    compute_dtype = None if load.compute_dtype is None else _dtype_name(load.compute_dtype)
    lora = load.lora
    config = _read_config(config_file, param_dtype, compute_dtype, load.scan_layers,
                          load.attention_impl, load.remat)
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    config = dataclasses.replace(config, attention_impl=resolve_attention_impl(
        load.attention_impl, platform=platform, compute_dtype=config.compute_dtype,
        head_dim=config.head_dim), lora=lora)

    def build():
        return Transformer(config, rngs=nnx.Rngs(0, lora=0 if lora is None else lora.seed))

    graphdef, adapters, abstract = nnx.split(nnx.eval_shape(build), nnx.LoRAParam, ...)
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda v: v.replace(device), abstract,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))
        adapter_shardings = jax.tree.map(lambda v: v.replace(device), adapters,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    else:
        shardings = state_shardings(abstract, mesh, rules)
        adapter_shardings = state_shardings(adapters, mesh, rules)
    if lora is not None:  # drawn in one program that computes nothing else (no random base)
        adapters = jax.jit(lambda: nnx.state(build(), nnx.LoRAParam),
                           out_shardings=adapter_shardings)()

    with ExitStack() as stack:
        checkpoint = _Checkpoint(path, stack)
        variables = nnx.to_flat_state(abstract)
        names = [hf_names.param_name(p, config.num_layers, config.num_experts,
                                      config.model_type) for p, _ in variables]
        # Check every tensor before reading any, so a bad checkpoint fails fast.
        for name, (_, variable) in zip(names, variables, strict=True):
            shape = variable.shape[1:] if name.stacked else variable.shape
            for parts in name.hf_names():
                for hf_name, hf_shape in zip(parts, hf_names.hf_shapes(name.kind, shape),
                                             strict=True):
                    checkpoint.check(hf_name, hf_shape)
        loaded = [
            (p, variable.replace(_load(checkpoint, name, variable.shape, sharding.get_value(),
                                       config)))
            for name, (p, variable), (_, sharding) in zip(
                names, variables, nnx.to_flat_state(shardings), strict=True)
        ]
    return nnx.merge(graphdef, adapters, nnx.from_flat_state(loaded))


def from_pretrained(path: str | Path, *, mesh: Mesh | None = None,
                    rules: AxisRules | None = None, **load: Any) -> Transformer:
    """`load_policy(path, LoadSettings(**load), mesh=mesh, rules=rules)`: the `LoadSettings`
    fields as keywords, in the Hugging Face spelling (`dtype="bfloat16"`, say)."""
    return load_policy(path, LoadSettings(**load), mesh=mesh, rules=rules)


def save_pretrained(model: Transformer, path: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `model` as an HF directory that `transformers` loads, in its parameter dtype
    (a model with LoRA adapters as its merged weights, W + s · A B).

    One `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when the tensors exceed `max_shard_bytes`. Weight files
    of an earlier save in `path` are removed first so no stale shard is left behind.
    """
    config = model.config
    path = Path(path)
    writer = jax.process_index() == 0
    dtype = jnp.dtype(config.param_dtype)
    params = nnx.state(model, nnx.Param)
    if config.lora is not None:
        params = merged_params(nnx.clone(model))
    variables = nnx.to_flat_state(params)

    # Plan the shards from shapes alone: tensors in variable order, a new shard whenever the
    # next tensor would overflow the current one.
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    total_bytes = 0
    for p, variable in variables:
        name = hf_names.param_name(p, config.num_layers, config.num_experts,
                                      config.model_type)
        shape = variable.shape[1:] if name.stacked else variable.shape
        part_shapes = hf_names.hf_shapes(name.kind, shape)
        for parts in name.hf_names():
            for hf_name, part_shape in zip(parts, part_shapes, strict=True):
                nbytes = math.prod(part_shape) * dtype.itemsize
                if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
                    shards.append([])
                    shard_bytes = 0
                shards[-1].append(hf_name)
                shard_bytes += nbytes
                total_bytes += nbytes
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    # to_hf may refuse the config; ask before anything in `path` is touched.
    hf_config = config.to_hf()
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        for old in path.iterdir():
            if _WEIGHT_FILE.fullmatch(old.name):
                old.unlink()
        _write_json(path / HF_CONFIG_FILE, hf_config)
        generation = {k: v for k, v in hf_config.items()
                      if k in ("bos_token_id", "eos_token_id") and v is not None}
        if generation:
            _write_json(path / "generation_config.json", generation)

    pending: dict[str, np.ndarray] = {}
    done = 0
    for p, variable in variables:
        name = hf_names.param_name(p, config.num_layers, config.num_experts,
                                      config.model_type)
        x = _to_host(variable.get_value()).astype(dtype)
        per_layer = list(x) if name.stacked else [x]
        for parts, array in zip(name.hf_names(), per_layer, strict=True):
            for hf_name, part in zip(parts, hf_names.to_hf(name.kind, array), strict=True):
                pending[hf_name] = np.ascontiguousarray(part)
        while done < len(shards) and all(n in pending for n in shards[done]):
            tensors = {n: pending.pop(n) for n in shards[done]}
            if writer:
                save_file(tensors, path / files[done], metadata={"format": "pt"})
            done += 1
    if writer and len(shards) > 1:
        weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
        _write_json(path / INDEX_FILE, {"metadata": {"total_size": total_bytes},
                                        "weight_map": weight_map})


def read_config(path: str | Path, *, dtype: str | jnp.dtype | None = None) -> ModelConfig:
    """The ModelConfig of an HF model directory's config.json, parameters in `dtype` (None:
    the checkpoint's), without reading any weight (what a memory check needs first)."""
    return _read_config(Path(path) / HF_CONFIG_FILE, None if dtype is None else _dtype_name(dtype),
                        None, False, "auto", "none")


# ------------------------------------------------------------------ loading helpers


def _read_config(config_file: Path, param_dtype: str | None, compute_dtype: str | None,
                 scan_layers: bool, attention_impl: AttentionImpl, remat: Remat) -> ModelConfig:
    """The ModelConfig of `config.json`; a malformed file is a CheckpointError naming it."""
    try:
        hf = json.loads(config_file.read_text())
        if param_dtype is None:
            param_dtype = _dtype_name(hf.get("torch_dtype") or hf.get("dtype") or "float32")
        return ModelConfig.from_hf(
            hf, param_dtype=param_dtype, compute_dtype=compute_dtype or param_dtype,
            scan_layers=scan_layers, attention_impl=attention_impl, remat=remat)
    except UnsupportedModelError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{config_file} lacks the key {e}") from None
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{config_file}: {e}") from None


class _Checkpoint:
    """The safetensors files of a directory, opened lazily (memory-mapped) once each."""

    def __init__(self, path: Path, stack: ExitStack):
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                self.files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index (JSON with a "
                                      f"weight_map of tensor -> file): {type(e).__name__}: "
                                      f"{e}") from None
        elif (path / SINGLE_FILE).is_file():
            self.files = [SINGLE_FILE]
        else:
            found = sorted(p.name for p in path.iterdir())
            raise FileNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r} (found: {', '.join(found)}); "
                "only safetensors checkpoints are supported")
        self.path = path
        self.handles: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        for file in self.files:
            if not (path / file).is_file():
                raise FileNotFoundError(f"{INDEX_FILE} lists {file!r}, which is missing in {str(path)!r}")
            try:
                handle = stack.enter_context(safe_open(path / file, framework="numpy"))
            except Exception as e:  # safetensors raises its own SafetensorError, or OSError
                raise _unreadable(path / file, e) from None
            self.handles[file] = handle
            for key in handle.keys():
                self.file_of.setdefault(key, file)

    def check(self, name: str, expected: tuple[int, ...]) -> None:
        if name not in self.file_of:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint {str(self.path)!r} "
                f"(searched: {', '.join(self.files)})")
        found = tuple(self.handles[self.file_of[name]].get_slice(name).get_shape())
        if found != expected:
            raise CheckpointError(
                f"tensor {name!r} in {self.file_of[name]} has shape {found}, but config.json "
                f"implies shape {expected}")

    def read(self, name: str, index: hf_names.Index) -> np.ndarray:
        file = self.file_of[name]
        try:
            return self.handles[file].get_slice(name)[index]
        except Exception as e:
            raise _unreadable(self.path / file, e, name) from None


def _unreadable(file: Path, e: Exception, tensor: str | None = None) -> CheckpointError:
    what = f" (reading tensor {tensor!r})" if tensor else ""
    return CheckpointError(f"{file} cannot be read as safetensors{what}: {type(e).__name__}: "
                           f"{str(e)[:300]}; the file is probably truncated or corrupted "
                           f"(an interrupted download or copy): fetch or save it again")


def _load(checkpoint: _Checkpoint, name: hf_names.ParamName, shape: tuple[int, ...],
          sharding: jax.sharding.Sharding, config: ModelConfig) -> jax.Array:
    """One parameter created on `sharding`, each device's slice read from disk."""
    dtype = jnp.dtype(config.param_dtype)
    hf = name.hf_names()

    def layer_slice(parts: tuple[str, ...], index: hf_names.Index) -> np.ndarray:
        reads = tuple(functools.partial(checkpoint.read, part) for part in parts)
        return hf_names.to_ours(name.kind, reads, index, config.head_dim,
                                config.num_heads // config.num_kv_heads)

    # Devices that hold the same slice (replication) share one read. Each distinct slice is
    # read, put on its devices and dropped before the next is read, so the host holds one
    # slice at a time (plus transfers still in flight) rather than, as
    # `jax.make_array_from_callback` would (it collects every device's slice before
    # transferring any), all of them: with `scan_layers` and replicated rules that is the
    # whole stacked [L, ...] tensor.
    devices_of: dict[tuple[tuple[int, int], ...], list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        devices_of.setdefault(key, []).append(device)
    shards = []
    for key, devices in devices_of.items():
        index = tuple(slice(start, stop) for start, stop in key)
        if name.stacked:
            out = np.stack([layer_slice(hf[i], index[1:]) for i in range(len(hf))[index[0]]])
        else:
            out = layer_slice(hf[0], index)
        out = np.ascontiguousarray(out.astype(dtype))
        shards += [jax.device_put(out, device) for device in devices]
        del out
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _dtype_name(dtype: str | jnp.dtype) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _DTYPES:
        raise ValueError(f"unsupported parameter dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    return name


# ------------------------------------------------------------------ saving helpers


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole of a (possibly sharded, possibly multi-host) array as a numpy array."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _write_json(file: Path, obj: dict[str, Any]) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
