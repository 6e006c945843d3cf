"""Typed configs: YAML + dotted overrides onto frozen dataclasses, errors that name the key."""

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from jaxrl.config import ConfigError, ModelSection, RolloutSection, load_config, to_yaml
from jaxrl.config.load import MOVED_KEYS
from jaxrl.rollout.settings import EngineConfig, SamplingParams


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
    with pytest.raises(ConfigError, match="'algo.temperature' was removed: "
                                          ".*rollout.sampling.temperature"):
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
    ("rollout.engine.page_size=0", r"rollout.engine.page_size must be >= 1, got 0"),
    ("rollout.engine.max_slots=0", r"rollout.engine.max_slots must be >= 1 or null, got 0"),
    ("rollout.engine.row_pages=-3", r"rollout.engine.row_pages must be >= 1 or null, got -3"),
    ("rollout.engine.pages_per_block=0", r"rollout.engine.pages_per_block must be >= 1, got 0"),
    ("rollout.engine.min_slots=1", r"rollout.engine.min_slots must be >= 2, 'auto' or null, "
                                   r"got 1"),
    ("rollout.engine.min_slots=most", r"'rollout.engine.min_slots': Value 'most'"),
    ("rollout.engine.batching=dynamic", r"rollout.engine.batching"),
    ("rollout.engine.attention=flash", r"rollout.engine.attention"),
    ("rollout.sampling.top_k=0", r"rollout.sampling.top_k must be >= 1 or null, got 0"),
])
def test_bad_engine_settings_name_the_key(override, match):
    """rollout.engine and rollout.sampling are the engine's own EngineConfig and
    SamplingParams: their checks, the key named by the loader."""
    with pytest.raises(ConfigError, match=match):
        load_config(Schema, None, [override])


def test_the_rollout_holds_the_engine_settings():
    cfg = load_config(Schema, None, ["rollout.engine.max_slots=8",
                                     "rollout.engine.batching=static"])
    assert cfg.rollout.engine == EngineConfig(max_slots=8, batching="static")
    with pytest.raises(ConfigError, match="rollout.engine.min_slots=4 shrinks continuous"):
        load_config(Schema, None, ["rollout.engine.min_slots=4",
                                   "rollout.engine.batching=static"])
    cfg = load_config(Schema, None, ["rollout.engine.max_slots=64", "rollout.engine.min_slots=4",
                                     "rollout.sampling.top_p=0.9"])
    assert cfg.rollout.engine.min_slots == 4
    assert cfg.rollout.sampling == SamplingParams(1.0, None, 0.9)
    # The default halves the tail by itself; static batching takes it (it never halves).
    assert load_config(Schema, None, []).rollout.engine.min_slots == "auto"
    load_config(Schema, None, ["rollout.engine.batching=static"])


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_moved_key_is_refused_naming_the_new_one(tmp_path, old):
    from jaxrl.config import ExperimentConfig

    message = f"config key {old} is now {MOVED_KEYS[old]}"
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, None, [f"{old}=1"])
    section, _, name = old.partition(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {name}: 1\n")
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, path)


def test_a_saved_config_of_an_earlier_version_has_its_moved_keys_moved(tmp_path):
    from jaxrl.config import ExperimentConfig

    assert MOVED_KEYS["rollout.temperature"] == "rollout.sampling.temperature"
    assert MOVED_KEYS["rollout.kv_pages"] == "rollout.engine.row_pages"
    old = tmp_path / "config.yaml"
    old.write_text("rollout:\n  num_generations: 2\n  temperature: 0.5\n  kv_pages: 12\n"
                   "  max_slots: 4\n"
                   "eval:\n  top_k: 3\n")
    cfg = load_config(ExperimentConfig, old, saved=True)
    assert cfg.rollout.sampling == SamplingParams(0.5)
    assert (cfg.rollout.engine.row_pages, cfg.rollout.engine.max_slots) == (12, 4)
    assert cfg.eval.sampling == SamplingParams(0.0, 3)
