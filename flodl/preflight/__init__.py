"""Everything checkable is checked in the launcher, before any rank starts (exit code 2).

Cheapest first, so a pure-config refusal exits before torch is imported:

1. the schema (:func:`flodl.config.validate_run_config`: types, ranges, unknown keys; dotted
   paths are located on disk, never imported);
2. the topology-bound knobs that need no factory (:func:`check_config`: precision, per-rank
   batch sizes);
3. a Hydra job's ``_target_`` factories (:func:`check_factories`: signatures, annotations,
   dataset length, then a dry build of model, optimizer and scheduler; imports torch);
4. the task's dotted paths and metrics (:func:`check_task_targets`; torchmetrics in the background);
5. per run, once the topology is known (:func:`check_run`, :func:`launch_signature`,
   :func:`check_launch`): callback rank, save path, resume bundle, the Python API's closures.
"""

from flodl.placement.batches import rank_batch_sizes, rank_devices
from flodl.preflight.launch import (
    check_config,
    check_launch,
    check_precision,
    check_run,
    format_lr_scaling,
    launch_signature,
    lr_scaling,
    rank_loaders,
)
from flodl.preflight.targets import bind, check_factories, check_task_targets, resolve

__all__ = [
    "bind",
    "check_config",
    "check_factories",
    "check_launch",
    "check_precision",
    "check_run",
    "check_task_targets",
    "format_lr_scaling",
    "launch_signature",
    "lr_scaling",
    "rank_batch_sizes",
    "rank_devices",
    "rank_loaders",
    "resolve",
]
