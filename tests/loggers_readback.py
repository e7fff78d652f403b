"""Read back what the loggers wrote, the way a user's tools would: csv, MLflow's store, W&B's
offline run file (a LevelDB-style log of protobuf records)."""

from __future__ import annotations

import csv
import json
import struct
from collections.abc import Iterator
from pathlib import Path


def csv_last(path: Path, kind: str = "epoch") -> dict[str, float]:
    """The last value of every scalar of ``kind`` in metrics.csv."""
    last: dict[str, float] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["kind"] == kind:
                last[row["name"]] = float(row["value"])
    return last


def mlflow_last(job_dir: Path) -> dict[str, float]:
    """The latest value of every metric of the one MLflow run under ``<job>/mlruns``."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        client = MlflowClient(tracking_uri=(job_dir / "mlruns").resolve().as_uri())
        (experiment,) = [e for e in client.search_experiments() if e.name == "flodl"]
        (run,) = client.search_runs([experiment.experiment_id])
        return dict(run.data.metrics)
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def _records(raw: bytes) -> Iterator[bytes]:
    block, pos, pending = 32768, 7, b""  # 7-byte file header; records never straddle blocks
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # block padding
            pos += left - 7
            continue
        pending += raw[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST fragment
            yield pending
            pending = b""


def wandb_history(job_dir: Path) -> list[dict[str, float]]:
    """Every ``run.log`` row of the one offline W&B run under ``<job>/wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = list((job_dir / "wandb").glob("offline-run-*/*.wandb"))
    rows = []
    for data in _records(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return rows


def wandb_last(job_dir: Path, x_axis: str = "epoch") -> dict[str, float]:
    """The last logged value of every key, over rows stepped by ``x_axis``."""
    last: dict[str, float] = {}
    for row in wandb_history(job_dir):
        if x_axis in row:
            last.update({k: v for k, v in row.items() if not k.startswith("_")})
    return last
