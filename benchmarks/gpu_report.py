"""The GPU check's summary: the curve arithmetic (time to a target, steady throughput) and
the table it prints (:mod:`benchmarks.gpu_check` runs the phases)."""

from __future__ import annotations

import statistics
from typing import Any

CIFAR_TARGETS = (0.90, 0.94)  # validation accuracy the cifar10-vit recipe aims at on one H200
IMDB_TARGET = 0.925  # the fine-tuned MLM encoder's aim


def first_event(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in events if e["event"] == kind), None)


def time_to(curve: list[dict[str, Any]], threshold: float) -> float | None:
    """Seconds (``t`` of the curve point) of the first evaluation at or above ``threshold``."""
    for p in curve:
        if p.get("val_acc") is not None and p["val_acc"] >= threshold:
            return p["t"]
    return None


def steady_throughput(events: list[dict[str, Any]]) -> float | None:
    """Median items/s of the train-metric windows after the first epoch (which includes
    compilation and warm-up); all windows when the run is shorter than that."""
    steps = [e for e in events if e["event"] == "step" and e.get("throughput")]
    later = [e for e in steps if e.get("epoch", 0) >= 1]
    pick = later or steps
    return float(statistics.median(e["throughput"] for e in pick)) if pick else None


# ----------------------------------------------------------------------------- FLOPs


def _f(v: Any, fmt: str = "{:.4f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _target(v: float | None, target: float) -> str:
    if v is None:
        return ""
    return f"  [target {target:.3g}: {'met' if v >= target else 'MISSED'}]"


def format_table(s: dict[str, Any]) -> str:
    dev = s["device"]
    rows: list[tuple[str, str]] = []
    c = s.get("cifar")
    if c:
        rows += [
            ("cifar10  recipe", f"{c['recipe']} ({c['status']}, {c['steps']} steps = "
                                f"{c['epochs']} epochs of batch {c['batch_size']})"),
            ("  final val acc", _f(c["final_val_acc"]) + _target(c["final_val_acc"],
                                                                   CIFAR_TARGETS[1])),
            ("  best val acc", _f(c["best_val_acc"])),
            ("  time to 90 %", _f(c["time_to_90_s"], "{:.1f} s", "not reached")
             + f"  ({_f(c['time_to_90_s_from_call'], '{:.1f} s', '-')} incl. set-up)"),
            ("  time to 94 %", _f(c["time_to_94_s"], "{:.1f} s", "not reached")
             + f"  ({_f(c['time_to_94_s_from_call'], '{:.1f} s', '-')} incl. set-up)"),
            ("  set-up / train / all", f"{c['setup_s']:.1f} s / {c['train_s']:.1f} s / "
                                       f"{c['total_s']:.1f} s"),
            ("  images/s", _f(c["images_per_s"], "{:,.0f}")),
            ("  FLOPs per image", _f(c.get("flops_per_item"), "{:.3e}") + " (fwd + bwd)"),
            ("  MFU", _f(c.get("mfu"), "{:.1%}") + f" of {dev['peak_flops']:.3g} FLOP/s"),
            ("  peak GPU memory", _f(c.get("peak_memory_gb"), "{:.1f} GiB")),
        ]
    im = s.get("imdb") or {}
    p, f = im.get("pretrain"), im.get("finetune")
    if p:
        rows += [
            ("imdb MLM recipe", f"{p['recipe']} ({p['status']}, {p['steps']} steps = "
                                f"{p['epochs']} epochs, {p['n_train']} reviews)"),
            ("  final val MLM loss", _f(p["final_val_loss"])),
            ("  set-up / train / all", f"{p['setup_s']:.1f} s / {p['train_s']:.1f} s / "
                                       f"{p['total_s']:.1f} s"),
            ("  tokens/s", _f(p["tokens_per_s"], "{:,.0f}")
             + f"  (MFU {_f(p.get('mfu'), '{:.1%}')})"),
        ]
    if f:
        rows += [
            ("imdb fine-tune recipe", f"{f['recipe']} ({f['status']}, {f['steps']} steps = "
                                      f"{f['epochs']} epochs)"),
            ("  final val acc", _f(f["final_val_acc"]) + _target(f["final_val_acc"],
                                                                   IMDB_TARGET)),
            ("  best val acc", _f(f["best_val_acc"])),
            ("  set-up / train / all", f"{f['setup_s']:.1f} s / {f['train_s']:.1f} s / "
                                       f"{f['total_s']:.1f} s"),
            ("  tokens/s", _f(f["tokens_per_s"], "{:,.0f}")),
            ("imdb total", _f(im.get("total_s"), "{:.1f} s")),
        ]
    for e in s.get("errors", []):
        rows.append((f"ERROR in {e['phase']}", e["error"][:200]))
    rows.append(("check total", f"{s.get('total_s', 0):.1f} s"))
    width = max(len(k) for k, _ in rows)
    head = (f"GPU check{' (DRY RUN: CPU, smoke recipes)' if s['dry_run'] else ''} on "
            f"{dev['name']}, torch {dev['torch']}, CUDA {dev['cuda']}")
    line = "-" * max(len(head), 72)
    return "\n".join([line, head, line] + [f"{k:<{width}}  {v}" for k, v in rows] + [line])


