"""Messages of the control plane. Plain frozen dataclasses: pickled only after authentication."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Chunk = tuple[int, int]  # (offset, size) into the epoch's permutation


@dataclass(frozen=True)
class Hello:
    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class Ready:
    """The rank built its model, joined the data plane and calibrated its pacing."""

    rank: int
    signature: str  # architecture fingerprint: names, shapes and dtypes of the state
    n_params: int
    step_ms: float  # the calibrated step (the MAX over ranks); 0.0 when nothing is paced
    device: str
    n_samples: int
    batch_size: int = 0  # this rank's batch size (configured or probed); 0: trainer.batch_size
    shard_sizes: tuple[int, ...] = ()  # a sharded dataset's samples per shard (flodl.data.streams)
    memory_plan: str = ""  # what the rank gave up to fit its device (cluster.memory_plan), said
    # its optimizer state is sharded across the cohort (memory_plan shard): nccl_sync's windows
    # then all-reduce gradients even where a rank has no batch (it steps its pieces)
    sharded_state: bool = False
    base: str | None = None  # its frozen parameters' fingerprint (runtime/sync/trainable.py)


@dataclass(frozen=True)
class Window:
    """One averaging window for one rank: the chunks it trains, then its averaging weights."""

    index: int
    epoch: int
    chunks: tuple[Chunk, ...]
    weight: float  # this rank's share of the parameter average
    buffer_weight: float  # this rank's share of the float-buffer average
    eval_after: bool = False  # evaluate after this window's average (the eval ranks only)
    eval_shard: tuple[int, int] = (0, 1)  # (shard, shards) of the eval set this rank evaluates
    max_overshoot: int = 0  # cpu_async: averages this rank may leave in flight
    # cpu_async, an epoch's last window: wait for its average and take it whole (no blend)
    consensus: bool = False
    checkpoint_after: bool = False  # write this rank's shard(s) after this window's average
    generation: int = 0  # membership generation it was planned for
    save_tag: str = ""  # names the shard files of that checkpoint
    write_weights: bool = False  # this rank also writes the consensus weights (one rank does)
    settle: bool = False  # the epoch's last window: acknowledge its averaging (Settled)
    progress: int = 0  # global progress clock: samples of the run dispatched before this window
    window_samples: int = 0  # samples of this window over all ranks
    grad_sync: bool = False  # nccl_sync: gradients all-reduced in backward (every rank steps)


@dataclass(frozen=True)
class Settled:
    """A rank's collective averaging of an epoch's last window held: the epoch may close."""

    rank: int
    window: int


@dataclass(frozen=True)
class Plan:
    windows: tuple[Window, ...]


@dataclass(frozen=True)
class PlannedWindow:
    """One window for every member at once: the fields they share stored once, each rank's
    own part keyed by rank. :meth:`window` is that rank's :class:`Window`."""

    index: int
    epoch: int
    chunks: dict[int, tuple[Chunk, ...]]  # member -> its chunks (every member of the window)
    weights: dict[int, tuple[float, float]]  # member -> (weight, buffer_weight)
    eval_shards: dict[int, tuple[int, int]] = field(default_factory=dict)  # the eval ranks only
    writer: int = -1  # the rank that writes the consensus weights of its checkpoint (-1: none)
    max_overshoot: int = 0
    consensus: bool = False
    checkpoint_after: bool = False
    generation: int = 0
    save_tag: str = ""
    settle: bool = False
    progress: int = 0
    window_samples: int = 0
    grad_sync: bool = False

    def window(self, rank: int) -> Window | None:
        chunks = self.chunks.get(rank)
        if chunks is None:
            return None
        weight, buffer_weight = self.weights[rank]
        shard = self.eval_shards.get(rank)
        return Window(
            self.index,
            self.epoch,
            chunks,
            weight,
            buffer_weight,
            eval_after=shard is not None,
            eval_shard=shard if shard is not None else (0, 1),
            max_overshoot=self.max_overshoot,
            consensus=self.consensus,
            checkpoint_after=self.checkpoint_after,
            generation=self.generation,
            save_tag=self.save_tag,
            write_weights=rank == self.writer,
            settle=self.settle,
            progress=self.progress,
            window_samples=self.window_samples,
            grad_sync=self.grad_sync,
        )


@dataclass(frozen=True)
class CohortPlan:
    """One planning step for the whole cohort: pickled once and the same bytes sent to every
    rank, whose link keeps only its own :class:`Plan` (:func:`own_part`). A 128-rank window
    then costs one pickle, not 128."""

    windows: tuple[PlannedWindow, ...]

    def for_rank(self, rank: int) -> Plan | None:
        own = tuple(w for w in (p.window(rank) for p in self.windows) if w is not None)
        return Plan(own) if own else None


def own_part(msg: Any, rank: int) -> Any:
    """What ``rank`` keeps of a received message: its Plan of a CohortPlan (None: nothing for
    it), any other message as it is."""
    return msg.for_rank(rank) if isinstance(msg, CohortPlan) else msg


@dataclass(frozen=True)
class Report:
    """What a rank did in one window; sent before it averages, so planning overlaps the sync."""

    rank: int
    window: int
    epoch: int
    chunks: tuple[Chunk, ...]
    batches: int
    samples: int
    compute_ms: float
    loss_sum: float
    loss_count: int
    scalars: dict[str, tuple[float, float]] = field(default_factory=dict)
    prev_sync_ms: float | None = None  # the previous window's averaging wall time
    prev_divergence: float | None = None
    lr: float | None = None
    snapshot: Any = None  # flat parameters (controller-averaged modes)
    data_ms: float = 0.0  # of compute_ms, the time spent waiting for batches
    overrun_ms: float = 0.0  # of compute_ms, paced steps running past their deadlines (CPU rig)
    peak_mem: int = 0  # bytes: CUDA max_memory_allocated, or the process's peak RSS on CPU
    steps: tuple[tuple[int, float, float], ...] = ()  # (rank step, loss, lr), every n-th step


@dataclass(frozen=True)
class Average:
    """Controller-averaged parameters sent back to a rank (cpu_* modes)."""

    window: int
    flat: Any


@dataclass(frozen=True)
class EvalResult:
    """One rank's eval shard: torchmetrics states (on CPU) the controller merges, then computes."""

    rank: int
    epoch: int
    window: int  # the window it evaluated after (a replanned window's stale result is ignored)
    parts: dict[str, Any]
    ms: float
    shard: int = 0


@dataclass(frozen=True)
class Stop:
    reason: str
    send_state: bool = False  # send Final (the first survivor, for the trained state)
    checkpoint: bool = False  # every rank writes its shard first (final or graceful save)
    save_tag: str = ""
    write_weights: bool = False
    # Keep the final weights until a later Stop releases this rank or asks it to send them
    # (the sender was lost after Stop: every survivor holds the same averaged weights).
    hold: bool = False


@dataclass(frozen=True)
class RankState:
    """A rank wrote its checkpoint shards (``rank<r>``: optimizer, scheduler, RNG, extra; and
    ``model`` from the one rank asked for the consensus weights). Each value is the written
    file's :class:`flodl.checkpoint.shards.ShardInfo`, or, for a store only the launcher can see
    (``memory://``), the shard's payload itself, streamed for the controller to write."""

    rank: int
    window: int  # the checkpoint's window (-1: the save at Stop)
    tag: str
    shards: dict[str, Any]
    error: str = ""  # the write failed: what went wrong (the controller fails the save)


@dataclass(frozen=True)
class Restore:
    """Sent before the first plan of a resumed run: where the rank finds its state (a shard
    location it loads itself, or the shard's payload when the store is the launcher's own)."""

    model: Any  # the consensus weights shard
    state: Any  # the optimizer/scheduler/RNG shard this rank takes over
    epoch: int
    lr_factor: float = 1.0  # lr scaling of this world over the saving world's (lr_scale_ratio)
    # every saved rank's shard (as ``state``), for optimizer state saved sharded
    # (memory_plan shard): a rank re-assembles the pieces it owns now from all of them
    states: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Final:
    rank: int
    params: dict[str, Any]  # the trainable parameters (a frozen base stays on the ranks)
    buffers: dict[str, Any]
    base: str | None = None  # the frozen base's fingerprint (runtime/sync/trainable.py)


@dataclass(frozen=True)
class RankError:
    """A rank failed: its message (one line) and the traceback for the log."""

    rank: int
    message: str
    traceback: str
    blame: str = ""  # "user" / "nonfinite": fails the job (trainer.on_rank_error); "": a loss


@dataclass(frozen=True)
class Abort:
    """The launcher ends the run (another rank failed): exit quietly, this is no lost launcher."""

    reason: str


@dataclass(frozen=True)
class Heartbeat:
    rank: int


@dataclass(frozen=True)
class Regroup:
    """Ranks were lost: rebuild the process group over ``members`` and re-average.

    Windows planned after ``last_window`` for an older generation are void: drop them.
    """

    generation: int
    members: tuple[int, ...]
    last_window: int
    weights: dict[int, float]  # each member's share of the re-average


@dataclass(frozen=True)
class Regrouped:
    rank: int
    generation: int
    unaveraged: int = -1  # the window whose collective averaging failed on this rank, if any
