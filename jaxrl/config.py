"""Experiment configs: frozen typed dataclasses, one per section, filled from YAML + overrides.

`load_config(Schema, path, ["model.dtype=bfloat16", ...])` merges the YAML file and dotted
overrides onto the dataclass schema with OmegaConf structured configs, which reject unknown
keys (suggesting the closest valid one) and values of the wrong type or outside a Literal's
choices; each section's `__post_init__` then checks what types cannot express. Every failure
is a `ConfigError` whose message names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl.rollout.sampling import SamplingParams

DType = Literal["float32", "bfloat16", "float16"]
Family = Literal["llama", "mistral", "qwen2", "qwen3"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


class RunDirError(ConfigError):
    """`train.run_dir` already holds a run (a run directory is never overwritten)."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str | None = None  # a local HF directory (config.json + *.safetensors)
    dtype: DType | None = None  # parameter dtype; None: the checkpoint's own
    compute_dtype: DType | None = None  # None: the parameter dtype
    scan_layers: bool = False
    attention_impl: Literal["xla", "cudnn"] = "xla"
    # Activation memory vs FLOPs of the backward pass: "block" keeps only each decoder
    # block's input and recomputes its forward, "save_dots" keeps the weight matmul outputs.
    remat: Literal["none", "block", "save_dots"] = "none"


@dataclasses.dataclass(frozen=True)
class ShardingSection:
    layout: str = "fsdp"  # a preset name in sharding/ or a path to a layout YAML


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    num_generations: int = 1  # samples per prompt (the GRPO group)
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 is greedy
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # besides the EOS ids
    # No stop tokens at all, EOS included: every training completion has exactly
    # max_new_tokens tokens (benchmarks; vLLM's ignore_eos). Evaluation still stops at EOS.
    ignore_eos: bool = False

    def __post_init__(self):
        for name in ("num_generations", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.ignore_eos and self.stop_token_ids:
            raise ValueError(f"rollout.ignore_eos=true stops on no token, but "
                             f"rollout.stop_token_ids={list(self.stop_token_ids)}; expected []")
        try:
            self.sampling_params()
        except ValueError as e:
            raise ValueError(f"rollout.{e}") from None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


def shipped_config(name: str) -> Path:
    """A config shipped with jaxrl (`quickstart.yaml`): the installed copy, else the
    repository's top-level `configs/` (a source checkout or an editable install)."""
    here = Path(__file__).resolve().parent
    for directory in (here / "configs", here.parent / "configs"):
        if (directory / name).is_file():
            return directory / name
    raise ConfigError(f"no shipped config {name!r} (looked in {here / 'configs'} and "
                      f"{here.parent / 'configs'})")


def load_config(schema: type[T], path: str | Path | None = None,
                overrides: Sequence[str] = ()) -> T:
    """The `schema` instance from a YAML file and `key.sub=value` overrides (later wins)."""
    merged = OmegaConf.structured(schema)
    sources: list[tuple[str, object]] = []
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        sources.append((str(path), lambda: OmegaConf.load(path)))
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        sources.append((key, lambda item=item: OmegaConf.from_dotlist([item])))
    for where, read in sources:
        try:
            merged = OmegaConf.merge(merged, read())
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(_describe(e, schema, where)) from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, schema, "?")) from None
    except (TypeError, ValueError) as e:  # from a section's __post_init__
        raise ConfigError(str(e)) from None


def _describe(error: Exception, schema: type, where: str) -> str:
    key = getattr(error, "full_key", None) or where
    message = str(error).splitlines()[0]
    hint = ""
    if "Did you mean" not in message and "not in" in message:
        close = difflib.get_close_matches(key, _all_keys(schema), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"config key {key!r}: {message}{hint}"


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for name, kind in typing.get_type_hints(schema).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(kind):
            keys.extend(_all_keys(kind, prefix + name + "."))
    return keys


def to_yaml(config: object) -> str:
    """The resolved config as YAML (what a run directory saves)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
