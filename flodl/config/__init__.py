"""The one source of truth for every knob: a pydantic schema, validated once in the launcher.

YAML in ``conf/`` (and a project's own ``conf/``) only composes; these modules decide what is
valid, one module per config group (``elche``, ``cluster``, ``loader``, ``logger``, ``trainer``,
``task``), with ``run`` for a whole composed run, ``groups`` for the groups whose options compose
from the schema, ``locate`` for dotted ``_target_`` paths and ``extras`` for the optional
dependencies a config needs. Every model is frozen and forbids unknown keys, so a typo
(``trainer.nmu_epochs``) is an error that names the key, never a silently ignored setting. Below
this boundary code receives typed objects, never a ``DictConfig``.
"""

from flodl.config.base import ConfigError
from flodl.config.cluster import (
    ClusterConfig,
    ControllerAddress,
    SlurmConfig,
    SshConfig,
    WorkerConfig,
)
from flodl.config.elche import (
    ELCHE_PRESETS,
    ElCheConfig,
    Guard,
    Mode,
    Outer,
    preset_yaml_keys,
)
from flodl.config.groups import SCHEMA_GROUPS, schema_node
from flodl.config.loader import LoaderConfig, LoaderOverride, Placement
from flodl.config.locate import check_locatable, defined_in_source, resolve_dotted
from flodl.config.logger import LoggerConfig, MlflowConfig, WandbConfig
from flodl.config.run import RunConfig, explain, validate_run_config, validate_trainer_config
from flodl.config.task import SchedulerConfig, TargetConfig, TaskConfig
from flodl.config.trainer import (
    CallbackPolicy,
    EarlyStoppingConfig,
    MonitorConfig,
    TrainerConfig,
    TrainerKnobs,
)

__all__ = [
    "ELCHE_PRESETS",
    "SCHEMA_GROUPS",
    "CallbackPolicy",
    "ClusterConfig",
    "ConfigError",
    "ControllerAddress",
    "EarlyStoppingConfig",
    "ElCheConfig",
    "Guard",
    "LoaderConfig",
    "LoaderOverride",
    "LoggerConfig",
    "MlflowConfig",
    "Mode",
    "MonitorConfig",
    "Outer",
    "Placement",
    "RunConfig",
    "SchedulerConfig",
    "SlurmConfig",
    "SshConfig",
    "TargetConfig",
    "TaskConfig",
    "TrainerConfig",
    "TrainerKnobs",
    "WandbConfig",
    "WorkerConfig",
    "check_locatable",
    "defined_in_source",
    "explain",
    "preset_yaml_keys",
    "resolve_dotted",
    "schema_node",
    "validate_run_config",
    "validate_trainer_config",
]
