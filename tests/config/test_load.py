"""Typed configs: YAML + dotted overrides onto frozen dataclasses, errors that name the key."""

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from jaxrl.config import ConfigError, ModelSection, RolloutSection, load_config, to_yaml


@dataclasses.dataclass(frozen=True)
class Section:
    size: int = 8
    mode: Literal["fast", "exact"] = "fast"

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"section.size must be >= 1, got {self.size}")


@dataclasses.dataclass(frozen=True)
class Schema:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    section: Section = dataclasses.field(default_factory=Section)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)


def test_yaml_then_overrides_later_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  dtype: bfloat16\nsection:\n  size: 4\n")
    cfg = load_config(Schema, path, ["section.size=16", "section.mode=exact"])
    assert cfg == Schema(model=ModelSection(dtype="bfloat16"), section=Section(16, "exact"))
    assert dataclasses.is_dataclass(cfg) and isinstance(cfg.section, Section)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.section.size = 3


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(Schema, None, ["model.path=/m", "section.mode=exact"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(Schema, path) == cfg


@pytest.mark.parametrize("override, words", [
    ("modle.dtype=float32", ["modle", "did you mean", "model"]),
    ("section.sise=3", ["section.sise", "did you mean", "size"]),
    ("section.size=abc", ["section.size", "abc", "integer"]),
    ("section.mode=slow", ["section.mode", "slow", "fast", "exact"]),
    ("model.dtype=float64", ["model.dtype", "float64", "bfloat16"]),
    ("model.remat=all", ["model.remat", "all", "none", "block", "save_dots"]),
    ("section=3", ["section", "int"]),
    ("section.size=0", ["section.size", ">= 1", "0"]),
    ("size", ["size", "dotted.key=value"]),
])
def test_bad_input_names_the_key(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(Schema, None, [override])
    message = str(info.value).lower()
    for word in words:
        assert word.lower() in message, (word, message)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Schema, tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(Schema, broken)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("section:\n  sizes: 3\n")
    with pytest.raises(ConfigError, match="section.sizes.*size"):
        load_config(Schema, unknown)


@pytest.mark.parametrize("content, words", [
    (b"- model\n- data\n", ["must hold a mapping of keys", "got a YAML list"]),
    (b"model:\n  path: [\n", ["is not valid YAML at line 3, column 1"]),
    (b"model:\n\tpath: x\n", ["is not valid YAML at line 2, column 1"]),
    (b"model:\n  path: \"caf\xe9\"\n", ["is not UTF-8 text (line 2, byte 20"]),
])
def test_a_config_file_that_is_not_a_yaml_mapping_is_named(tmp_path, content, words):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(Schema, path)
    message = str(info.value)
    assert f"config file {str(path)!r}" in message
    for word in words:
        assert word in message, (word, message)


def test_a_directory_as_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; expected a YAML file"):
        load_config(Schema, tmp_path)


def test_ignore_eos_takes_no_stop_token_ids():
    cfg = load_config(Schema, None, ["rollout.ignore_eos=true"])
    assert cfg.rollout.ignore_eos and cfg.rollout.stop_token_ids == []
    with pytest.raises(ConfigError, match=r"rollout.ignore_eos=true .* "
                                          r"rollout.stop_token_ids=\[7\]; expected \[\]"):
        load_config(Schema, None, ["rollout.ignore_eos=true", "rollout.stop_token_ids=[7]"])


def test_a_removed_key_says_why_and_a_saved_config_drops_it(tmp_path):
    from jaxrl.config import ExperimentConfig
    from jaxrl.config.load import REMOVED_KEYS

    quickstart = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match="'algo.temperature' was removed: .*rollout.temperature"):
        load_config(ExperimentConfig, quickstart, ["algo.temperature=1.0"])
    # A run directory of an earlier version saved algo.temperature (always = the rollout's).
    cfg = load_config(ExperimentConfig, quickstart)
    old = tmp_path / "config.yaml"
    old.write_text(to_yaml(cfg).replace("algo:\n", "algo:\n  temperature: 1.0\n"))
    assert "algo.temperature" in REMOVED_KEYS
    with pytest.raises(ConfigError, match="was removed"):
        load_config(ExperimentConfig, old)
    assert load_config(ExperimentConfig, old, saved=True) == cfg


@pytest.mark.parametrize("override, match", [
    ("rollout.page_size=0", r"rollout.page_size must be >= 1, got 0"),
    ("rollout.max_slots=0", r"rollout.max_slots must be >= 1 or null, got 0"),
    ("rollout.kv_pages=-3", r"rollout.kv_pages must be >= 1 or null, got -3"),
    ("rollout.min_slots=1", r"rollout.min_slots must be >= 2, 'auto' or null, got 1"),
    ("rollout.min_slots=most", r"rollout.min_slots must be an integer >= 2, 'auto' or null, "
                               r"got 'most'"),
    ("rollout.batching=dynamic", r"rollout.batching"),
    ("rollout.attention=flash", r"rollout.attention"),
])
def test_bad_engine_settings_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Schema, None, [override])
    cfg = load_config(Schema, None, ["rollout.max_slots=8", "rollout.batching=static"])
    assert cfg.rollout.engine_config().max_slots == 8
    assert cfg.rollout.engine_config().batching == "static"
    with pytest.raises(ConfigError, match="rollout.min_slots=4 shrinks continuous"):
        load_config(Schema, None, ["rollout.min_slots=4", "rollout.batching=static"])
    cfg = load_config(Schema, None, ["rollout.max_slots=64", "rollout.min_slots=4"])
    assert cfg.rollout.engine_config().min_slots == 4
    # The default halves the tail by itself; static batching takes it (it never halves).
    assert load_config(Schema, None, []).rollout.engine_config().min_slots == "auto"
    load_config(Schema, None, ["rollout.batching=static"])
