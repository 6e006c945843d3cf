"""Every config of jaxrl: one module per group of sections, `load_config` to fill them."""

from jaxrl.config.algo import AlgoSection, OptimSection
from jaxrl.config.experiment import ExperimentConfig
from jaxrl.config.load import RunDirError, load_config, shipped_config, to_yaml
from jaxrl.config.model import (
    DType,
    Family,
    InitSection,
    ModelSection,
    ShardingSection,
    TrainModelSection,
)
from jaxrl.config.run import LogSection, PerfSection, TrainSection
from jaxrl.config.sampling import EvalSection, RolloutSection
from jaxrl.config.serve import ServeSection
from jaxrl.config_base import ConfigError, fail, require_at_least
from jaxrl.data.section import DataSection
from jaxrl.distributed.settings import DistributedSection

__all__ = [
    "AlgoSection", "ConfigError", "DType", "DataSection", "DistributedSection", "EvalSection",
    "ExperimentConfig", "Family", "InitSection", "LogSection", "ModelSection", "OptimSection",
    "PerfSection", "RolloutSection", "RunDirError", "ServeSection", "ShardingSection",
    "TrainModelSection", "TrainSection", "fail", "load_config", "require_at_least",
    "shipped_config", "to_yaml",
]
