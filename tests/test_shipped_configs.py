"""Every shipped experiment config and layout preset loads into its schema."""

from pathlib import Path

import pytest

from jaxrl.commands.check import CheckConfig
from jaxrl.commands.generate import GenerateConfig
from jaxrl.config import load_config
from jaxrl.sharding import load_layout

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {"check.yaml": CheckConfig, "generate.yaml": GenerateConfig}


def test_every_config_has_a_schema():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(SCHEMAS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_config_loads_and_names_a_real_layout(name):
    cfg = load_config(SCHEMAS[name], ROOT / "configs" / name)
    assert isinstance(cfg, SCHEMAS[name])
    load_layout(cfg.sharding.layout)
