"""Evaluation metrics: updated per batch, merged over shards, computed once — no processes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

from flodl.step.evaluation import EVAL_LOSS, EvalSpec, SampleMean, evaluate, merge, shard_range


class SampleCount(Metric):
    """How many samples the metric saw: a sum, which a mean of chunk values gets wrong."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("n", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.n += target.shape[0]

    def compute(self) -> torch.Tensor:
        return self.n


def _trained_classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A linear model fit briefly on three noisy Gaussian classes: imperfect, uneven errors."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 5, generator=g) * 1.5
    y = torch.randint(0, 3, (1000,), generator=g)
    x = centers[y] + torch.randn(1000, 5, generator=g) * 1.5
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, x, y


def _batches(x: torch.Tensor, y: torch.Tensor, start: int, stop: int, size: int):
    for first in range(start, stop, size):
        yield x[first : min(first + size, stop)], y[first : min(first + size, stop)]


def _spec() -> EvalSpec:
    return EvalSpec(
        metrics={
            "count": SampleCount,
            "f1": lambda: MulticlassF1Score(num_classes=3, average="macro"),
            "accuracy": lambda: MulticlassAccuracy(num_classes=3, average="micro"),
            "auroc": lambda: MulticlassAUROC(num_classes=3, average="macro", thresholds=None),
        },
        eval_loss=F.cross_entropy,
    )


def _eval(model, x, y, shards: int, chunk: int) -> dict[str, float]:
    parts = []
    for shard in range(shards):
        start, stop = shard_range(len(x), shard, shards)
        parts.append(evaluate(model, _batches(x, y, start, stop, chunk), _spec(), "cpu"))
    return merge(parts)


def test_metrics_equal_scikit_learn_on_the_trained_models_predictions() -> None:
    model, x, y = _trained_classifier()
    values = _eval(model, x, y, shards=1, chunk=256)
    with torch.no_grad():
        logits = model(x)
    pred = logits.argmax(1).numpy()
    assert values["count"] == 1000  # exact, not the mean chunk size (250) of a chunk average
    assert values["f1"] == pytest.approx(f1_score(y.numpy(), pred, average="macro"), abs=1e-6)
    assert values["accuracy"] == pytest.approx(float((pred == y.numpy()).mean()), abs=1e-6)
    probs = logits.softmax(1).numpy()
    auc = roc_auc_score(y.numpy(), probs, multi_class="ovr", average="macro")
    assert values["auroc"] == pytest.approx(auc, abs=1e-5)
    assert values[EVAL_LOSS] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)
    assert 0.5 < values["accuracy"] < 0.99  # imperfect, so F1 and accuracy really differ


def test_shards_and_chunk_sizes_do_not_change_any_metric() -> None:
    model, x, y = _trained_classifier()
    whole = _eval(model, x, y, shards=1, chunk=1000)
    # Not chunks of 1: torchmetrics tells logits from probabilities per update batch, and one
    # row of logits may happen to lie in [0, 1].
    for shards, chunk in ((2, 256), (3, 77), (7, 5)):
        assert _eval(model, x, y, shards, chunk) == pytest.approx(whole, rel=1e-6, abs=1e-6)


def test_a_mean_of_chunk_f1_scores_is_not_the_f1_score() -> None:
    """Why metrics are merged, not averaged: the old per-chunk mean is off for F1."""
    model, x, y = _trained_classifier()
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    chunks = [(s, min(s + 64, 1000)) for s in range(0, 1000, 64)]
    averaged = sum(
        f1_score(y[a:b].numpy(), pred[a:b], average="macro") * (b - a) for a, b in chunks
    )
    true_f1 = _eval(model, x, y, shards=1, chunk=64)["f1"]
    assert abs(averaged / 1000 - true_f1) > 1e-4


def test_legacy_eval_fn_is_the_sample_weighted_mean_of_its_chunk_means() -> None:
    model, x, y = _trained_classifier()

    def chunk_accuracy(m, inputs, target):
        return float((m(inputs).argmax(1) == target).float().mean())

    spec = EvalSpec(eval_fn=chunk_accuracy, eval_fn_name="acc")
    parts = [
        evaluate(model, _batches(x, y, a, b, 300), spec, "cpu") for a, b in ((0, 700), (700, 1000))
    ]
    with torch.no_grad():
        exact = float((model(x).argmax(1) == y).float().mean())
    assert merge(parts) == {"acc": pytest.approx(exact, abs=1e-6)}
    assert spec.names == ["acc"] and _spec().names[0] == EVAL_LOSS


def test_shard_ranges_cover_every_sample_once() -> None:
    for n, shards in ((10, 3), (2, 5), (1000, 7)):
        ranges = [shard_range(n, i, shards) for i in range(shards)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_vector_metrics_are_reported_per_element_and_bad_factories_are_named() -> None:
    per_class = MulticlassAccuracy(num_classes=3, average=None)
    per_class.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))
    assert merge([{"acc": per_class}]) == {"acc/0": 1.0, "acc/1": 0.5, "acc/2": 1.0}
    with pytest.raises(TypeError, match=r"task.metrics.bad: must build a torchmetrics Metric"):
        EvalSpec(metrics={"bad": lambda: 0.5}).build(torch.device("cpu"))
    mean = SampleMean()
    mean.update(1.0, 3)
    mean.update(0.0, 1)
    assert float(mean.compute()) == 0.75


def test_merge_never_all_gathers_in_a_process_that_holds_a_group(tmp_path, monkeypatch) -> None:
    """torchrun / SLURM rank0 placement: the controller shares rank 0's process and group."""
    import torch.distributed as dist

    def no_collective(*args, **kwargs):
        raise AssertionError("merge called a collective")

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_gather", no_collective)
        monkeypatch.setattr(dist, "all_gather_object", no_collective)
        metric = MulticlassAccuracy(num_classes=3, average="micro")
        metric.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2]))
        assert merge([{"accuracy": metric}]) == {"accuracy": 0.75}
    finally:
        dist.destroy_process_group()
