"""``logger``: TensorBoard, CSV, W&B and MLflow, and the dashboard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flodl.config.base import _Schema


class WandbConfig(_Schema):
    """Weights & Biases run (``pip install wandb``); offline by default: no network, no login."""

    project: str = Field("flodl", min_length=1, description="W&B project name")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline writes <job>/wandb for a later `wandb sync`"
    )
    entity: str | None = Field(None, description="W&B team or user (online mode)")
    name: str | None = Field(None, description="run name (default: the job directory's name)")


class MlflowConfig(_Schema):
    """MLflow run (``pip install mlflow-skinny``) in a local file store by default."""

    tracking_uri: str | None = Field(
        None, description="tracking URI (default: a file store in <job>/mlruns)"
    )
    experiment: str = Field("flodl", min_length=1, description="MLflow experiment name")
    run_name: str | None = Field(None, description="run name (default: the job directory's name)")


class LoggerConfig(_Schema):
    """What the launcher writes and prints."""

    tensorboard: bool = Field(True, description="write TensorBoard event files under <job>/tb")
    csv: bool = Field(True, description="write every logged scalar to <job>/metrics.csv")
    wandb: WandbConfig | None = Field(None, description="also log to Weights & Biases")
    mlflow: MlflowConfig | None = Field(None, description="also log to MLflow")
    log_every_n_steps: int | None = Field(
        None, ge=1, description="log each rank's training loss and LR every N of its steps"
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="console level")
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto", description="progress bar on a terminal, epoch lines otherwise"
    )
    serve: int | None = Field(None, ge=0, le=65535, description="serve TensorBoard on this port")
    host: str = Field("127.0.0.1", description="address the dashboard binds")
    keep_serving: bool = Field(False, description="keep the dashboard up after the run ends")
