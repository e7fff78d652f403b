"""LoRA adapters on a slow link: what crosses the wire, and what it costs, against full
fine-tuning and torch DDP with the same adapters.

    .venv/bin/python -m bench.hf_lora --quick   # 1 epoch of 60 k characters -> hf_lora_quick.json
    .venv/bin/python -m bench.hf_lora           # 3 epochs -> hf_lora.json

A small GPT-2-style model (4 layers, 4 heads, width 128, 512-token byte-level BPE trained on the
offline Shakespeare corpus, block 64; built from a config, float32) on the 2-rank CPU rig
[1.0, 0.5] with ``cluster.link=1gbe``. Variants: flodl ``nccl_cadence`` with rank-4 LoRA
adapters on the attention projections, flodl ``nccl_cadence`` fine-tuning every parameter,
torch DDP with the same adapters (bench/ddp.py: the same pacing and the same modelled wire, a
communication hook per bucket), and solo LoRA (one in-process rank, no link) as the reference
validation loss. Every variant evaluates once, after training (outside its training time), so
"time to solo's loss" is its training time when its final validation loss is at most solo's.
Bytes per window are the flat state every mode averages (``FlatState``: what
``collective_average`` hands the all-reduce and charges to the link, tests/integration/
test_hf_adapters.py). Each variant runs in a fresh process, one after the other; the machine's
load average is recorded before and after each.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from typing import Any

from bench.common import child_main, log, machine, run_isolated, write_result

SPEEDS = [1.0, 0.5]
LINK = "1gbe"
BATCH = 16
SEED = 42
CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 512,
    "n_positions": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}
LR = {True: 2e-3, False: 5e-4}  # adapters take a larger step than a full fine-tune


class Model:
    """The model factory (picklable): LoRA on a frozen base, or every parameter trainable."""

    def __init__(self, lora: bool) -> None:
        self.lora = lora

    def __call__(self, device: Any = None) -> Any:
        from flodl.hf.models import auto_model

        model = auto_model(config=CONFIG, peft=LORA if self.lora else None)
        return model.to(device) if device is not None else model


class Optim:
    def __init__(self, lora: bool) -> None:
        self.lr = LR[lora]

    def __call__(self, params: Any) -> Any:
        import torch

        return torch.optim.AdamW(params, lr=self.lr)


def data_kwargs(max_chars: int) -> dict[str, Any]:
    return {
        "text_fn": "flodl.recipes.text.offline_corpus",
        "train_tokenizer_vocab": CONFIG["vocab_size"],
        "block_size": CONFIG["n_positions"],
        "max_chars": max_chars,
    }


def dataset(split: str, max_chars: int) -> Any:
    from flodl.hf.data import text_dataset

    return text_dataset(split, **data_kwargs(max_chars))


def wire_bytes(lora: bool) -> int:
    """Bytes of one average: the flat state every mode all-reduces (or sends) per window."""
    from flodl.runtime.sync.averaging import FlatState

    flat = FlatState(Model(lora)()).flatten()
    return flat.numel() * flat.element_size()


# -- one variant, in its own process -------------------------------------------------------------
def run_one(p: dict[str, Any]) -> dict[str, Any]:
    if p["variant"] == "ddp_lora":
        return _run_ddp(p)
    return _run_flodl(p)


def _run_flodl(p: dict[str, Any]) -> dict[str, Any]:
    from functools import partial

    from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
    from flodl.hf.steps import causal_lm_outputs, causal_lm_step, token_cross_entropy

    lora, solo = p["variant"] != "full", p["variant"] == "solo_lora"
    cluster = (
        ClusterConfig(kind="cpu_rig", ranks=1, speeds=[1.0])
        if solo
        else ClusterConfig(kind="cpu_rig", ranks=2, speeds=SPEEDS, link=LINK)
    )
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flodl-bench-hf-") as tmp:
        handle = (
            Trainer.builder(Model(lora), Optim(lora), causal_lm_step)
            .dataset(partial(dataset, "train", p["max_chars"]))
            .eval_dataset(partial(dataset, "test", p["max_chars"]))
            .eval_step(causal_lm_outputs)
            .eval_loss(token_cross_entropy)
            .eval_every(p["epochs"])  # after training only, as the DDP tier: not in train_s
            .batch_size(BATCH)
            .num_epochs(p["epochs"])
            .seed(SEED)
            .lr_scale_ratio(0.0)
            .elche(ElCheConfig(mode="solo" if solo else "nccl_cadence"))
            .cluster(cluster)
            .logger(LoggerConfig(progress="off", tensorboard=False, level="WARNING"))
            .output_dir(tmp)
            .run()
        )
        handle.join()
        result = handle.result
    s = result.summary
    train_s = s.samples_seen / s.samples_per_s if s.samples_per_s else math.nan
    curve = [[train_s, e.eval_metrics.get("eval_loss")] for e in result.epochs if e.eval_metrics]
    return {
        "status": s.status,
        "samples_per_s": s.samples_per_s,
        "train_s": train_s,
        "syncs": s.syncs,
        "mean_sync_ms": s.mean_sync_ms,
        "final_loss": s.final_loss,
        "eval_loss": curve[-1][1] if curve else None,
        "curve": curve,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def ddp_parts(cfg: dict[str, Any]) -> tuple[Any, Any, Any, int, Any, Any]:
    """bench/ddp.py's workload hook: the LoRA model on dict batches of token blocks."""
    import torch

    from flodl.hf.steps import causal_lm_outputs, causal_lm_step, token_cross_entropy

    blocks = dataset("train", cfg["max_chars"]).tensors["input_ids"]
    held = dataset("test", cfg["max_chars"]).tensors["input_ids"]
    model = Model(True)()

    def evaluate(state: dict[str, Any]) -> float:
        probe = Model(True)()
        probe.load_state_dict(state)
        probe.eval()
        total = 0.0
        with torch.no_grad():
            for lo in range(0, len(held), 64):
                batch = {"input_ids": held[lo : lo + 64]}
                total += float(token_cross_entropy(*causal_lm_outputs(probe, batch))) * len(
                    batch["input_ids"]
                )
        return total / len(held)

    return (
        model,
        Optim(True),
        causal_lm_step,
        len(blocks),
        lambda idx: {"input_ids": blocks[idx]},
        evaluate,
    )


def _run_ddp(p: dict[str, Any]) -> dict[str, Any]:
    from bench.ddp import run_ddp

    r = run_ddp(
        SPEEDS,
        epochs=p["epochs"],
        batch_size=BATCH,
        seed=SEED,
        link=LINK,
        parts="bench.hf_lora:ddp_parts",
        extra={"max_chars": p["max_chars"]},
    )
    return {
        "status": r["status"],
        "samples_per_s": r["samples_per_s"],
        "train_s": r["train_s"],
        "syncs": r["syncs"],
        "final_loss": r["final_loss"],
        "eval_loss": r["test_metric"],
        "curve": [[r["train_s"], r["test_metric"]]],
        "load_before": r["load_before"],
        "load_after": r["load_after"],
    }


# -- the table -------------------------------------------------------------------------------------
def time_to(curve: list[list[float]], target: float | None) -> float | None:
    """Training seconds until the validation loss first reached ``target`` (None: never)."""
    if target is None:
        return None
    return next((t for t, loss in curve if loss is not None and loss <= target), None)


_NAMES = {
    "solo_lora": "solo, LoRA (reference)",
    "lora": "flodl nccl_cadence, LoRA",
    "full": "flodl nccl_cadence, full fine-tuning",
    "ddp_lora": "torch DDP, LoRA",
}


def hf_lora_block(data: dict[str, Any], machine_line: str) -> str:
    """The docs' table (bench/render.py): one row per variant, the bytes and the verdicts."""
    s, rows = data["settings"], data["rows"]

    def num(x: Any, fmt: str) -> str:
        return format(x, fmt) if isinstance(x, (int, float)) else "\u2013"

    table = [
        "| variant | bytes / window | windows | samples/s | train s | val loss | "
        "s to solo's val loss | load before / after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        load = f"{num((r.get('load_before') or [None])[0], '.2f')} / "
        load += num((r.get("load_after") or [None])[0], ".2f")
        table.append(
            f"| {_NAMES.get(r['variant'], r['variant'])} | {num(r.get('bytes_per_window'), ',d')} "
            f"| {num(r.get('syncs') if r['variant'] != 'solo_lora' else None, 'd')} "
            f"| {num(r.get('samples_per_s'), '.1f')} | {num(r.get('train_s'), '.1f')} "
            f"| {num(r.get('eval_loss'), '.3f')} | {num(r.get('time_to_solo_loss_s'), '.1f')} "
            f"| {load} |"
        )
    by = {r["variant"]: r for r in rows}
    lora, ddp = by.get("lora", {}), by.get("ddp_lora", {})
    speedup = (
        lora["samples_per_s"] / ddp["samples_per_s"]
        if lora.get("samples_per_s") and ddp.get("samples_per_s")
        else None
    )
    quick = " **Quick run** (1 epoch)." if s.get("quick") else ""
    speeds = s["speeds"]
    ceiling = sum(speeds) / (len(speeds) * min(speeds))  # every rank busy vs lock-step pace
    notes = [
        f"LoRA bytes per window: {s['bytes_lora']:,} of the full model's {s['bytes_full']:,} "
        f"= {100 * s['bytes_ratio']:.2f} % (target \u2264 2 %: "
        f"{'met' if s['bytes_ratio'] <= 0.02 else 'missed'}).",
        f"flodl LoRA vs torch DDP LoRA, samples/s: {num(speedup, '.2f')}\u00d7 "
        f"(target \u2265 2\u00d7: {'met' if speedup and speedup >= 2 else 'missed'}; on this rig "
        f"no more than {ceiling:.2f}\u00d7 comes from the unequal speeds, the sum of the speeds "
        "over lock-step's ranks x slowest, and the adapters' all-reduce per DDP step is small).",
        f"Rig {s['speeds']}, `cluster.link={s['link']}`, batch {s['batch_size']} per rank, "
        f"{s['epochs']} epoch(s) of the first {s['max_chars']:,} characters, lr "
        f"{s['lr']['lora']} (LoRA) / {s['lr']['full']} (full).{quick}",
    ]
    return machine_line + "\n\n" + "\n".join(table) + "\n\n" + " ".join(notes)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if child_main(argv, run_one):
        return 0
    quick = "--quick" in argv
    epochs, max_chars = (1, 60000) if quick else (3, 60000)
    stem = "hf_lora_quick" if quick else "hf_lora"
    dataset("train", max_chars)  # tokenizer and blocks cached once, before any timed run
    dataset("test", max_chars)
    lora_bytes, full_bytes = wire_bytes(True), wire_bytes(False)
    rows = []
    for variant in ("solo_lora", "lora", "full", "ddp_lora"):
        log(f"{variant} ...")
        t0 = time.perf_counter()
        payload = {"variant": variant, "epochs": epochs, "max_chars": max_chars}
        row = run_isolated("bench.hf_lora", payload, timeout_s=1200)
        row.update(variant=variant, wall_s=time.perf_counter() - t0)
        row["bytes_per_window"] = {"lora": lora_bytes, "full": full_bytes}.get(
            variant.replace("solo_", "").replace("ddp_", "")
        )
        rows.append(row)
        log(f"{variant}: {row.get('status')} eval_loss {row.get('eval_loss')}")
    target = next((r.get("eval_loss") for r in rows if r["variant"] == "solo_lora"), None)
    for row in rows:
        row["time_to_solo_loss_s"] = time_to(row.get("curve") or [], target)
    data = {
        "benchmark": "hf_lora",
        "command": "python -m bench.hf_lora " + " ".join(argv),
        "machine": machine(),
        "settings": {
            "quick": quick,
            "epochs": epochs,
            "max_chars": max_chars,
            "batch_size": BATCH,
            "speeds": SPEEDS,
            "link": LINK,
            "model": CONFIG,
            "lora": LORA,
            "lr": {"lora": LR[True], "full": LR[False]},
            "bytes_lora": lora_bytes,
            "bytes_full": full_bytes,
            "bytes_ratio": lora_bytes / full_bytes,
            "solo_eval_loss": target,
        },
        "rows": rows,
    }
    data["machine"]["load_average_end"] = list(os.getloadavg())
    log(f"LoRA bytes per window: {lora_bytes} of {full_bytes} ({lora_bytes / full_bytes:.4f})")
    log(f"wrote {write_result(stem, data)}")
    return 0 if all(r.get("status") == "ok" for r in rows) and math.isfinite(lora_bytes) else 1


if __name__ == "__main__":
    sys.exit(main())
