"""flodl: one PyTorch training step, from one device to many unequal ones.

    from flodl import Trainer, ElCheConfig
    state = (Trainer.builder(model_factory, optim_factory, train_step)
             .dataset(ds).batch_size(64).num_epochs(5)
             .elche(ElCheConfig.nccl_cadence()).run().join())
"""

from flodl.config import (
    CallbackPolicy,
    ClusterConfig,
    ConfigError,
    ElCheConfig,
    LoggerConfig,
    Mode,
    TrainerConfig,
)
from flodl.metrics import EpochMetrics, RunSummary, SyncEvent, record_scalar
from flodl.trainer import RunHandle, TrainedState, Trainer, TrainerBuilder

__version__ = "0.1.0"

__all__ = [
    "CallbackPolicy",
    "ClusterConfig",
    "ConfigError",
    "ElCheConfig",
    "EpochMetrics",
    "LoggerConfig",
    "Mode",
    "RunHandle",
    "RunSummary",
    "SyncEvent",
    "TrainedState",
    "Trainer",
    "TrainerBuilder",
    "TrainerConfig",
    "__version__",
    "record_scalar",
]
