"""``task``, ``model``, ``optimizer``, ``scheduler``: what trains (dotted ``_target_`` paths)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from flodl.config.base import _Schema
from flodl.config.locate import check_locatable


class TargetConfig(_Schema):
    """A ``_target_`` reference plus its keyword arguments (extra keys are the kwargs)."""

    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)
    target: str = Field(alias="_target_", description="dotted path of a callable")

    @field_validator("target")
    @classmethod
    def _importable(cls, v: str) -> str:
        check_locatable(v)
        return v

    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class SchedulerConfig(TargetConfig):
    """An LR scheduler reference; ``interval`` says how it advances (the rest are its kwargs)."""

    interval: Literal["step", "epoch"] = Field(
        "epoch",
        description="step: advanced on the global progress clock per optimizer step; "
        "epoch: stepped once per epoch",
    )


class TaskConfig(_Schema):
    """What one step and one evaluation mean for the chosen model."""

    train_step: str = Field(description="dotted path: fn(model, batch) -> loss")
    eval_fn: str | None = Field(
        None, description="dotted path: fn(model, input, target) -> the chunk's mean over samples"
    )
    metrics: dict[str, TargetConfig] = Field(
        default_factory=dict, description="name -> torchmetrics Metric (_target_ + kwargs)"
    )
    eval_loss: str | None = Field(
        None, description="dotted path: fn(preds, target) -> mean loss, reported as eval_loss"
    )
    eval_step: str | None = Field(
        None, description="dotted path: fn(model, batch) -> (preds, target) (default: model(x), y)"
    )
    eval_metric: str = Field("accuracy", description="the eval metric summaries call eval_value")
    eval_higher_is_better: bool = Field(True, description="direction of the eval metric")
    objective: str = Field(
        "auto",
        min_length=1,
        description="a job's return value for optimizing sweepers: auto (final eval value, "
        "else final loss), eval, loss, or a numeric summary.json key (dots reach nested keys)",
    )
    objective_direction: Literal["auto", "minimize", "maximize"] = Field(
        "auto", description="direction of the objective (auto: the eval metric's, loss: minimize)"
    )
    metrics_fn: str | None = Field(
        None, description="dotted path: fn(EpochMetrics), launcher; a truthy return stops the run"
    )
    eval_result_fn: str | None = Field(None, description="dotted path: fn(epoch, value), launcher")
    epoch_fn: str | None = Field(None, description="dotted path: fn(epoch), launcher")

    @field_validator(
        "train_step",
        "eval_fn",
        "eval_loss",
        "eval_step",
        "metrics_fn",
        "eval_result_fn",
        "epoch_fn",
    )
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        if v is not None:
            check_locatable(v)
        return v

    @property
    def has_eval(self) -> bool:
        return self.eval_fn is not None or self.eval_loss is not None or bool(self.metrics)

    @property
    def eval_names(self) -> list[str]:
        """Names of the eval metrics this task reports (``eval_loss`` is the eval loss)."""
        names = ["eval_loss"] if self.eval_loss is not None else []
        if self.eval_fn is not None:
            names.append(self.eval_metric)
        return names + [n for n in self.metrics if n not in names]

    @model_validator(mode="after")
    def _metric_named(self) -> TaskConfig:
        if "eval_loss" in self.metrics:
            raise ValueError("metrics.eval_loss: the name is taken by the eval loss; rename it")
        if self.has_eval and self.eval_metric not in self.eval_names:
            raise ValueError(
                f"eval_metric={self.eval_metric}: not one of the eval metrics "
                f"({', '.join(self.eval_names)}); name one of them"
            )
        return self
