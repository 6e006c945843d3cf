"""Loading configs: YAML + dotted overrides merged onto a frozen dataclass schema.

`load_config(Schema, path, ["model.dtype=bfloat16", ...])` merges the YAML file and dotted
overrides onto the dataclass schema with OmegaConf structured configs, which reject unknown
keys (suggesting the closest valid one) and values of the wrong type or outside a Literal's
choices; each section's `__post_init__` then checks what types cannot express. Every failure
is a `ConfigError` whose message names the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl.config_base import ConfigError, read_yaml

SchemaT = TypeVar("SchemaT")


class RunDirError(ConfigError):
    """`train.run_dir` already holds a run (a run directory is never overwritten)."""


def shipped_config(name: str) -> Path:
    """A config shipped with jaxrl (`quickstart.yaml`): the installed copy, else the
    repository's top-level `configs/` (a source checkout or an editable install)."""
    here = Path(__file__).resolve().parents[1]  # the jaxrl package
    for directory in (here / "configs", here.parent / "configs"):
        if (directory / name).is_file():
            return directory / name
    raise ConfigError(f"no shipped config {name!r} (looked in {here / 'configs'} and "
                      f"{here.parent / 'configs'})")


# Keys that earlier versions had (and wrote into a run's config.yaml), and why they are gone.
# A config or override that sets one is an error saying so; a run's saved config drops it.
REMOVED_KEYS = {
    "algo.temperature": "the trainer scores every token at rollout.sampling.temperature, the "
                        "distribution it was sampled from; set that instead",
}

# Keys that moved when the sections came to hold the library's own types (the sampler's
# SamplingParams, the engine's EngineConfig): old key -> new key. A config or override that
# sets an old key is an error naming the new one; a run's saved config has it moved.
MOVED_KEYS = {
    **{f"{section}.{name}": f"{section}.sampling.{name}"
       for section in ("rollout", "eval", "serve") for name in ("temperature", "top_k", "top_p")},
    **{f"rollout.{name}": f"rollout.engine.{name}"
       for name in ("batching", "max_slots", "page_size", "min_slots", "attention")},
    "rollout.kv_pages": "rollout.engine.row_pages",
}


def load_config(schema: type[SchemaT], path: str | Path | None = None,
                overrides: Sequence[str] = (), *, saved: bool = False) -> SchemaT:
    """The `schema` instance from a YAML file and `key.sub=value` overrides (later wins).
    `saved`: the file is a run's config.yaml, written maybe by an earlier version: keys of
    REMOVED_KEYS are dropped from it, those of MOVED_KEYS moved."""
    merged = copy.deepcopy(_structured(schema))
    sources: list[tuple[str, object]] = []
    if path is not None:
        tree = read_yaml(path, what="config file")
        sources.append((str(path), lambda: upgrade_saved(tree) if saved else tree))
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        sources.append((key, lambda item=item: OmegaConf.from_dotlist([item])))
    # unsafe_merge: merged into `merged` in place, each source's nodes moved, not copied
    # (OmegaConf.merge deep-copies the whole tree at every source; benchmarks/README.md,
    # "Host-side setup costs"). Every source is read fresh here and used once.
    for where, read in sources:
        try:
            merged = OmegaConf.unsafe_merge(merged, read())
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            raise ConfigError(_describe(e, schema, where)) from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, schema, "?")) from None
    except (TypeError, ValueError) as e:  # from a section's __post_init__
        raise ConfigError(_placed(e, merged)) from None


@functools.cache
def _structured(schema: type) -> DictConfig:
    """`schema`'s defaults as an OmegaConf tree, made once (copying it is cheaper than
    building it again from the dataclasses)."""
    return OmegaConf.structured(schema)


def upgrade_saved(config: Any) -> Any:
    """`config` (an OmegaConf tree of a saved config.yaml) without the REMOVED_KEYS and with
    the MOVED_KEYS at their new keys."""
    for key in (*REMOVED_KEYS, *MOVED_KEYS):
        section, _, name = key.rpartition(".")
        parent = OmegaConf.select(config, section)
        if parent is not None and name in parent:
            value = parent.pop(name)
            if key in MOVED_KEYS:
                OmegaConf.update(config, MOVED_KEYS[key], value, force_add=True)
    return config


def _placed(error: Exception, node: Any, key: str = "") -> str:
    """The message of `error`, raised making the section `node` (at `key`) or one inside it.
    A type held at several keys (SamplingParams, EngineConfig) names its fields alone: a
    message that starts with a field of the section that raised (`top_k must be ...`) gets
    the section's key before it."""
    for name in node:
        child = node[name]
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            try:
                OmegaConf.to_object(child)
            except (TypeError, ValueError) as e:
                return _placed(e, child, f"{key}{name}.")
    message = str(error)
    first = re.match(r"\w+", message)
    fields = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
    return key + message if key and first and first.group() in fields else message


def _describe(error: Exception, schema: type, where: str) -> str:
    key = getattr(error, "full_key", None) or where
    if key in REMOVED_KEYS:
        return f"config key {key!r} was removed: {REMOVED_KEYS[key]}"
    if key in MOVED_KEYS:
        return f"config key {key} is now {MOVED_KEYS[key]} (README: Config keys that moved)"
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
