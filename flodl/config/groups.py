"""The config groups that compose from the schema: each option of ``conf/<group>/`` lists
``_schema`` (every key of its section that has a default, at that default, registered in Hydra's
ConfigStore by the launcher plugin) before its own keys, so every key is there to override without
``+`` (``cluster.memory_plan=none`` with ``cluster=auto``; ``cluster.link.profile=1gbe``) and an
option states only what it changes. An optional sub-section an option switches on
(``logger=wandb``) composes the same way from ``<group>/_<key>``."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_jsonable_python

from flodl.config.base import _Schema
from flodl.config.cluster import ClusterConfig
from flodl.config.elche import ElCheConfig
from flodl.config.loader import LoaderConfig
from flodl.config.logger import LoggerConfig, MlflowConfig, WandbConfig
from flodl.config.task import SchedulerConfig, TaskConfig
from flodl.config.trainer import TrainerKnobs

#: The groups whose options extend ``<group>/_schema``, and the section each one fills. The
#: ``_target_`` groups (model, optimizer, dataset) have no key beyond their target's arguments.
SCHEMA_GROUPS: dict[str, type[_Schema]] = {
    "elche": ElCheConfig,
    "cluster": ClusterConfig,
    "trainer": TrainerKnobs,
    "loader": LoaderConfig,
    "logger": LoggerConfig,
    "task": TaskConfig,
    "scheduler": SchedulerConfig,
}

#: Optional sub-sections (null by default) an option switches on, by group: ``<group>/_<key>``
#: holds the sub-section at its defaults (``logger/_wandb``: ``wandb: {project, mode, ...}``).
SCHEMA_SUBSECTIONS: dict[str, dict[str, type[_Schema]]] = {
    "logger": {"wandb": WandbConfig, "mlflow": MlflowConfig},
}


def defaults_of(model: type[_Schema]) -> dict[str, Any]:
    """Every key of ``model`` that has a default, at that default, as plain data (a required
    key, such as a ``_target_``, is the option's to state)."""
    return {
        field.alias or name: to_jsonable_python(
            field.get_default(call_default_factory=True), by_alias=True
        )
        for name, field in model.model_fields.items()
        if not field.is_required()
    }


def schema_node(group: str) -> dict[str, Any]:
    """``<group>/_schema``: Hydra's base for the group's options."""
    return defaults_of(SCHEMA_GROUPS[group])


def subsection_nodes() -> dict[tuple[str, str], dict[str, Any]]:
    """``(group, "_<key>")`` -> ``{key: the sub-section at its defaults}``, for each one."""
    return {
        (group, f"_{key}"): {key: defaults_of(model)}
        for group, sections in SCHEMA_SUBSECTIONS.items()
        for key, model in sections.items()
    }
