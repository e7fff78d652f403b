"""A whole composed run validated once, and pydantic's errors turned into one line a user reads."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from flodl.config.base import ConfigError, UnknownKey, _Schema, did_you_mean, schema_keys
from flodl.config.cluster import ClusterConfig
from flodl.config.elche import ElCheConfig
from flodl.config.loader import LoaderConfig
from flodl.config.logger import LoggerConfig
from flodl.config.task import SchedulerConfig, TargetConfig, TaskConfig
from flodl.config.trainer import TrainerConfig, TrainerKnobs


class RunConfig(_Schema):
    """The composed Hydra config (``conf/config.yaml`` or a project's own), validated once
    in the launcher."""

    model: TargetConfig
    optimizer: TargetConfig
    dataset: TargetConfig
    task: TaskConfig
    scheduler: SchedulerConfig | None = Field(
        None, description="per-rank LR scheduler (total_steps: auto = the run's length)"
    )
    trainer: TrainerKnobs = Field(default_factory=TrainerKnobs)
    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    experiment: str | None = Field(None, description="name of the experiment overlay, if any")

    @model_validator(mode="after")
    def _monitors_known(self) -> RunConfig:
        known = ["train_loss", *self.task.eval_names]
        for key in ("early_stopping", "save_best"):
            watch = getattr(self.trainer, key)
            if watch is not None and watch.monitor not in known:
                raise ValueError(
                    f"trainer.{key}.monitor={watch.monitor}: not a metric of this task; "
                    f"one of {', '.join(known)}"
                )
        return self

    def trainer_config(self) -> TrainerConfig:
        """The Python API's config bag: trainer knobs with the sibling sections folded in."""
        return TrainerConfig(
            **dict(self.trainer),
            elche=self.elche,
            cluster=self.cluster,
            logger=self.logger,
            loader=self.loader,
        )

    def digest(self) -> str:
        """Stable hash of the resolved config (goes into checkpoint metadata)."""
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _format_location(loc: tuple[Any, ...], prefix: str) -> str:
    parts = [str(p) for p in loc if not str(p).startswith("function-after")]
    key = ".".join(p for p in parts if p)
    return f"{prefix}.{key}" if prefix and key else (key or prefix)


def _lookup(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if (isinstance(data, Mapping) and part in data) or (
            isinstance(data, list) and isinstance(part, int) and part < len(data)
        ):
            data = data[part]
        else:
            return None
    return data


def _keys_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys the schema accepts at ``loc`` (a section's model, walked from ``model``), or None
    where the path leaves the schema's models (a list, a dict of any keys, a union)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list of models: the list's item model (below)
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return None
        annotation = fields[part].annotation
        current = None
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            inner = getattr(candidate, "__args__", ())
            for option in (candidate, *inner):
                if isinstance(option, type) and issubclass(option, BaseModel):
                    current = option
                    break
            if current is not None:
                break
        if current is None:
            return None
    return schema_keys(current) if isinstance(current, type) else None


def explain(
    exc: ValidationError, data: Any, prefix: str = "", model: type[BaseModel] | None = None
) -> ConfigError:
    """Turn a pydantic error into one line: ``key=value: what is allowed`` (``model``: the schema
    validated, for the likely key of a misspelt one)."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = _format_location(loc, prefix)
    msg = err["msg"].removeprefix("Value error, ")
    unknown = (err.get("ctx") or {}).get("error")
    if isinstance(unknown, UnknownKey):  # a nested model's own __init__ refused a key
        hint = did_you_mean(unknown.key, unknown.known, f"{key}." if key else "")
        if not hint:
            hint = f"; allowed: {', '.join(sorted(unknown.known))}"
        return ConfigError(f"{f'{key}.' if key else ''}{unknown.key}: unknown key{hint}")
    if err["type"] == "extra_forbidden":
        known = _keys_at(model, loc[:-1]) if model is not None else None
        if known:
            parent = key.rpartition(".")[0]
            hint = did_you_mean(str(loc[-1]), known, f"{parent}." if parent else "")
            if not hint:
                hint = f"; allowed: {', '.join(sorted(known))}"
            return ConfigError(f"{key}: unknown key{hint}")
        return ConfigError(
            f"{key}: unknown key (check the spelling; flodl's keys are in the schema, "
            "flodl.config, and its config groups, conf/)"
        )
    if err["type"] == "missing":
        return ConfigError(f"{key}: required key is missing")
    value = _lookup(data, loc)
    if err["type"] == "finite_number":
        msg = "must be finite (a number, not NaN or inf)"
    if err["type"] == "value_error" and (isinstance(value, Mapping) or not key):
        # A check across a section's keys: its message names the key; no dump of the section.
        named = re.match(r"[A-Za-z_][\w.]*=", msg) is not None
        return ConfigError(msg if not key else f"{key}.{msg}" if named else f"{key}: {msg}")
    shown = json.dumps(value) if isinstance(value, (list, dict)) else value
    return ConfigError(f"{key}={shown}: {msg}")


def validate_run_config(data: Mapping[str, Any]) -> RunConfig:
    """Validate a composed, resolved config; raise :class:`ConfigError` on the first fault."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise explain(exc, data, model=RunConfig) from None


def validate_trainer_config(data: Mapping[str, Any]) -> TrainerConfig:
    try:
        return TrainerConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise explain(exc, data, "trainer", model=TrainerConfig) from None
