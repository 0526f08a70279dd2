"""Metric series of a job from its JSON-lines progress log, bounded in size for the web page.

The trainer prints one JSON object per event (``step`` every few steps with ``loss``, ``lr``,
``acc``...; ``epoch`` with ``val_acc`` / ``val_loss``; ``end`` with the final validation). Each
numeric field becomes a series of ``[step, value]`` points. A resumed job rewinds to its
checkpoint: a point at or before the last one's step replaces the points from there on, so every
series stays increasing in step (and a ``start`` event at step ``S`` voids every point after
``S``, for series whose next point comes later). Long runs are downsampled to at most
``max_points`` per series (evenly over the index, first and last point kept).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.progress import Event

TRAIN_KEYS = ("loss", "lr", "acc", "grad_norm", "throughput")  # from "step" events
VAL_KEYS = ("val_acc", "val_loss")  # from "epoch" and "end" events
MAX_LOG_BYTES = 64 * 1024 * 1024  # never read more than this much of one log


def _append(series: list[list[float]], step: float, value: float) -> None:
    while series and series[-1][0] >= step:  # a resume rewound: drop the replaced points
        series.pop()
    series.append([step, value])


def downsample(points: list[list[float]], max_points: int) -> list[list[float]]:
    """At most ``max_points`` points, evenly spaced over the index, first and last kept."""
    n = len(points)
    if n <= max_points:
        return points
    if max_points <= 1:
        return points[-1:]
    idx = sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [points[i] for i in idx]


def read_series(path: Path, max_points: int = 500) -> dict[str, Any]:
    """``{"series": {name: [[step, value], ...]}, "points": total before downsampling,
    "downsampled": bool, "eta_s", "step", "total_steps"}`` from a progress log."""
    series: dict[str, list[list[float]]] = {}
    last: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:  # the newest MAX_LOG_BYTES of a huge log
            f.seek(0, 2)
            f.seek(max(0, f.tell() - MAX_LOG_BYTES))
            data = f.read()
    except OSError:
        data = b""
    for raw in data.splitlines():
        if not raw.startswith(b'{"event"'):
            continue
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        kind, step = event.get("event"), event.get("step")
        if not isinstance(step, (int, float)):
            continue
        if kind == Event.start:  # a (re)start from a checkpoint at `step`: later points are void
            for points in series.values():
                while points and points[-1][0] > step:
                    points.pop()
        keys = (TRAIN_KEYS if kind == Event.step
                else VAL_KEYS if kind in (Event.epoch, Event.end) else ())
        for k in keys:
            v = event.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _append(series.setdefault(k, []), step, float(v))
        if kind == Event.step:
            last = {k: event.get(k) for k in ("eta_s", "step", "total_steps")}
        elif kind == Event.end:
            last = {"eta_s": 0.0, "step": step, "total_steps": event.get("total_steps")}
    total = sum(len(s) for s in series.values())
    out = {k: downsample(v, max_points) for k, v in series.items()}
    return {"series": out, "points": total,
            "downsampled": any(len(out[k]) < len(series[k]) for k in series), **last}
