"""``trainer``: the training loop's knobs (epochs, batch, checkpoints, faults, callbacks)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flodl.config.base import _Schema
from flodl.config.cluster import ClusterConfig
from flodl.config.elche import ElCheConfig
from flodl.config.loader import LoaderConfig
from flodl.config.logger import LoggerConfig
from flodl.config.registries.modes import MODES
from flodl.config.registries.plan_elements import PLAN_ELEMENTS


class CallbackPolicy(_Schema):
    """Which rank runs eval/epoch callbacks: the fastest (default) or a fixed global rank."""

    kind: Literal["fastest", "rank"] = "fastest"
    rank: int = Field(0, ge=0)


class MonitorConfig(_Schema):
    """A quantity to watch: an eval metric name (``eval_loss``, ``accuracy``, ...) or
    ``train_loss``, and whether lower (``min``) or higher (``max``) is better."""

    monitor: str = Field("eval_loss", min_length=1, description="eval metric name or train_loss")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher")


class EarlyStoppingConfig(MonitorConfig):
    """Stop every rank once ``monitor`` has not improved for ``patience`` evaluated epochs."""

    patience: int = Field(3, ge=1, description="evaluated epochs without improvement to stop")
    min_delta: float = Field(0.0, ge=0, description="smallest change that counts as improvement")


class TrainerKnobs(_Schema):
    """Training-loop knobs: the ``trainer`` node of the Hydra config."""

    batch_size: int = Field(64, ge=1, description="per-rank batch size")
    num_epochs: int = Field(1, ge=1, description="passes over the dataset")
    seed: int = Field(42, ge=0, description="seeds model init and the per-epoch permutation")
    max_grad_norm: float | None = Field(None, gt=0, description="clip gradients to this L2 norm")

    @field_validator("max_failure", check_fields=False)
    @classmethod
    def _max_failure(cls, v: int | str | None) -> int | str | None:
        return _check_max_failure(v)

    @model_validator(mode="after")
    def _saves_need_a_path(self) -> TrainerKnobs:
        return _check_save_best(self)

    lr_scale_ratio: float = Field(
        1.0, ge=0, le=1, description="LR x (1 + (world-1) x ratio): 1 = linear rule, 0 = off"
    )
    eval_every: int = Field(1, ge=1, description="evaluate every N epochs (when eval is set)")
    callback_policy: CallbackPolicy = Field(default_factory=CallbackPolicy)
    eval_policy: Literal["elected", "sharded"] = Field(
        "elected", description="evaluate on the callback_policy rank, or 1/N on every rank"
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="stop every rank when a metric stops improving"
    )
    save_best: MonitorConfig | None = Field(
        None, description="keep the best bundle as <save_path>_best beside the last"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="in-process device")
    save_path: str | None = Field(
        None, description="bundle stem (path or fsspec URL): <stem>.meta.json + shard files"
    )
    resume_from: str | None = Field(None, description="bundle stem to resume from")
    resume_fallback: bool = Field(
        False, description="resume from an older bundle when the newest is damaged (else: error)"
    )
    checkpoint_every: int | None = Field(None, ge=1, description="save every N epochs")

    @field_validator("save_path", "resume_from", check_fields=False)
    @classmethod
    def _stem_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("empty: give a path or fsspec URL, or null")
        return v

    max_failure: int | str | None = Field(
        None, description="ranks that may be lost (count or 'N%') before save-and-stop; null: any"
    )
    max_nonfinite: int = Field(
        10,
        ge=0,
        description="steps with NaN/inf loss or gradients skipped (warned) before the run stops",
    )
    on_rank_error: Literal["fail", "drop"] = Field(
        "fail",
        description="an exception of the user's code on a rank: fail the job, or drop the rank",
    )
    precision: Literal["32", "bf16-mixed", "16-mixed"] = Field(
        "32", description="32 (fp32), bf16-mixed (autocast) or 16-mixed (fp16 + GradScaler, CUDA)"
    )
    accumulate_grad_batches: int = Field(
        1, ge=1, le=4096, description="micro-batches whose gradients make one optimizer step"
    )
    compile: bool = Field(False, description="torch.compile each rank's model for the step")

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def _check_save_best(knobs: TrainerKnobs) -> TrainerKnobs:
    if knobs.checkpoint_every is not None and knobs.save_path is None:
        raise ValueError(
            f"checkpoint_every={knobs.checkpoint_every} needs trainer.save_path (nothing would "
            "be saved): set trainer.save_path to a bundle stem, or trainer.checkpoint_every=null"
        )
    if knobs.save_best is not None and knobs.save_path is None:
        raise ValueError(
            "save_best needs trainer.save_path: the best bundle is written beside it as "
            "<save_path>_best"
        )
    return knobs


def _check_max_failure(v: int | str | None) -> int | str | None:
    if v is None:
        return v
    if isinstance(v, int):
        if v < 0:
            raise ValueError("must be >= 0 (a count) or a percentage like '50%'")
        return v
    text = v.strip()
    try:
        percent = float(text.removesuffix("%"))
    except ValueError:
        raise ValueError("must be a count like 1 or a percentage like '50%'") from None
    if not text.endswith("%") or not 0 <= percent <= 100:
        raise ValueError("must be a count like 1 or a percentage like '50%'")
    return text


TrainerKnobs.model_rebuild()


class TrainerConfig(TrainerKnobs):
    """The Python API's config bag: the loop knobs plus the ElChe, cluster and logger sections."""

    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)

    @model_validator(mode="after")
    def _elements_fit_the_mode(self) -> TrainerConfig:
        policy = self.elche.mode.policy
        for name in sorted(self.cluster.planned_elements()):
            needs = PLAN_ELEMENTS[name].needs_mode
            if needs is None or getattr(policy, needs):
                continue
            able = " or ".join(m.value for m, p in MODES.items() if getattr(p, needs))
            raise ValueError(
                f"cluster.memory_plan={self.cluster.memory_plan}: {name} splits training state "
                "across ranks that step with the same gradient, which only "
                f"elche.mode={able} does (mode is {self.elche.mode.value}); use offload, "
                f"or elche.mode={able}"
            )
        return self

    def with_(self, **updates: Any) -> TrainerConfig:
        """A validated copy with ``updates`` applied (``model_copy`` skips validation)."""
        return type(self).model_validate({**self.model_dump(), **updates})
