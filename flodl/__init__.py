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

# The trainer pulls in torch; keep `import flodl.sys` / `flodl.monitor` / the Hydra plugin light.
_LAZY = {"RunHandle", "TrainedState", "Trainer", "TrainerBuilder"}


def __getattr__(name: str):  # PEP 562: load the trainer on first use
    if name in _LAZY:
        from flodl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'flodl' has no attribute {name!r}")


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
