"""The bottom of every config: `ConfigError` (what every problem with a config file or
override is), `read_yaml` (a YAML file of keys, its problems named by file, line and column)
and the one message of a bad value (`fail`, `require_at_least`). It sits below every package,
so a package's own settings (a sharding layout file, the `distributed` section) read and check
themselves as the config sections (`jaxrl.config`) do, without importing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def read_yaml(path: str | Path, *, what: str) -> Any:
    """The OmegaConf mapping of the YAML file `path`; a ConfigError naming the file (and YAML's
    line and column) when it is missing, unreadable, not YAML or not a mapping of keys."""
    path = Path(path)
    if not path.is_file():
        where = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"{what} {str(path)!r} {where}; expected a YAML file")
    try:
        tree = OmegaConf.load(path)
    except UnicodeDecodeError as e:
        line = bytes(e.object[:e.start]).count(b"\n") + 1
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text (line {line}, byte "
                          f"{e.start + 1}: {e.reason}); expected a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML{at}: {problem}") from None
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {e.strerror or e}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{what} {str(path)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(tree, DictConfig):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of keys "
                          f"(key: value lines), got a YAML list")
    return tree


def fail(section: str, obj: Any, name: str, requirement: str) -> NoReturn:
    """Raises the one message of a bad config value: `section.name must be ..., got ...` (a
    tuple shown as the YAML list it was written as)."""
    value = getattr(obj, name)
    raise ValueError(f"{section}.{name} must be {requirement}, got "
                     f"{list(value) if isinstance(value, tuple) else value!r}")


def require_at_least(section: str, obj: Any, names: tuple[str, ...], minimum: int = 1,
                     note: str = "") -> None:
    """`fail`s on the first of `names` whose value (None is skipped) is below `minimum`."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            fail(section, obj, name, f">= {minimum}{note}")
