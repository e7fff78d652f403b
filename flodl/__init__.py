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
    ControllerAddress,
    EarlyStoppingConfig,
    ElCheConfig,
    LoggerConfig,
    MlflowConfig,
    Mode,
    MonitorConfig,
    SlurmConfig,
    SshConfig,
    TrainerConfig,
    WandbConfig,
    WorkerConfig,
)
from flodl.monitor.metrics import EpochMetrics, RunSummary, SyncEvent, record_scalar
from flodl.placement.cluster import ClusterBuilder

# The trainer pulls in torch; keep `import flodl.placement.gpus` / `flodl.monitor` / the Hydra
# plugin light.
_LAZY = {
    "RunHandle": "flodl.trainer",
    "TrainedState": "flodl.checkpoint.results",
    "Trainer": "flodl.trainer",
    "TrainerBuilder": "flodl.trainer",
    "Ddp": "flodl.ddp",
    "Rendezvous": "flodl.ddp",
    "Monitor": "flodl.monitor.monitor",
}


def __getattr__(name: str):  # PEP 562: load torch-heavy modules on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flodl' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CallbackPolicy",
    "ClusterBuilder",
    "ClusterConfig",
    "ConfigError",
    "ControllerAddress",
    "Ddp",
    "EarlyStoppingConfig",
    "ElCheConfig",
    "EpochMetrics",
    "LoggerConfig",
    "MlflowConfig",
    "Mode",
    "Monitor",
    "MonitorConfig",
    "Rendezvous",
    "RunHandle",
    "RunSummary",
    "SlurmConfig",
    "SshConfig",
    "SyncEvent",
    "TrainedState",
    "Trainer",
    "TrainerBuilder",
    "TrainerConfig",
    "WandbConfig",
    "WorkerConfig",
    "__version__",
    "record_scalar",
]
