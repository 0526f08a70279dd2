"""Training progress for humans (a tqdm bar on a terminal) or machines (JSON lines on stdout).

When stdout is not a TTY every event is one JSON object per line on stdout, so a job runner can
follow a run::

    {"event": "start", "total_steps": 880, "mlflow_run_id": "...", "run_name": "...", ...}
    {"event": "step", "epoch": 0, "step": 20, "total_steps": 880, "loss": 2.1, "lr": 1e-4,
     "throughput": 812.3, "acc": 0.21, "data_time_frac": 0.04, "eta_s": 1020.0}
    {"event": "epoch", "epoch": 0, "step": 88, "val_loss": 1.9, "val_acc": 0.31, ...}
    {"event": "end", "status": "finished"|"stopped"|"interrupted", "val_acc": ..., ...}

Everything else (log messages) goes to stderr through ``logging``. The event kinds and the end
statuses are :class:`Event` and :class:`RunStatus`, shared with the job runner that reads them
(``serving.jobs``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from enum import StrEnum
from typing import IO, Any

# how `vit-service train` states a usage error (a bad recipe value, missing data) on stderr,
# one line, before exiting 2: a job runner quotes that line as the job's reason
ERROR_PREFIX = "error: "


class Event(StrEnum):
    """The ``event`` field of a progress line."""

    start = "start"
    step = "step"
    epoch = "epoch"
    end = "end"
    # printed by the job runner's node check before the trainer starts (serving.jobs.commands)
    preflight = "preflight"
    # where a multi-node run's workers are (placed, first step, checkpoint, restarted):
    # training/ray_train.py; folded into the job's progress apart from the run's metrics
    cluster = "cluster"


class RunStatus(StrEnum):
    """How a run ended: the ``status`` of its ``end`` event."""

    finished = "finished"  # every step done
    stopped = "stopped"  # stopped early on purpose (a time budget, early stopping)
    interrupted = "interrupted"  # a signal: resumable from the last checkpoint


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else round(v, 6)
    return v


class Progress:
    """``start`` / ``step`` / ``epoch`` / ``end`` events; silent when ``enabled`` is False
    (non-zero DDP ranks)."""

    def __init__(self, enabled: bool = True, json_lines: bool | None = None,
                 stream: IO[str] | None = None, unit: str = "img") -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.json = (not self.stream.isatty()) if json_lines is None else json_lines
        self.unit = unit
        self.bar: Any = None
        self.total_steps = 0
        self.run_id: str | None = None
        self._t0 = time.perf_counter()
        self._step0 = 0

    def _emit(self, event: Event, **fields: Any) -> None:
        rec = {"event": event.value, **{k: _clean(v) for k, v in fields.items()}}
        if self.run_id and "mlflow_run_id" not in rec:
            rec["mlflow_run_id"] = self.run_id
        self.stream.write(json.dumps(rec) + "\n")
        self.stream.flush()

    def start(self, total_steps: int, step: int = 0, **info: Any) -> None:
        self.total_steps, self._step0 = total_steps, step
        self.run_id = info.get("mlflow_run_id")
        self._t0 = time.perf_counter()
        if not self.enabled:
            return
        if self.json:
            self._emit(Event.start, step=step, total_steps=total_steps, **info)
        else:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True,
                            desc=info.get("run_name", "train"))

    def eta(self, step: int) -> float | None:
        done = step - self._step0
        if done <= 0:
            return None
        return (time.perf_counter() - self._t0) / done * (self.total_steps - step)

    def step(self, step: int, epoch: int, **metrics: Any) -> None:
        if not self.enabled:
            return
        if self.json:
            self._emit(Event.step, epoch=epoch, step=step, total_steps=self.total_steps,
                       eta_s=self.eta(step), **metrics)
        elif self.bar is not None:
            self.bar.n = step
            tp = metrics.get("throughput")
            self.bar.set_postfix(
                epoch=epoch, loss=f"{metrics.get('loss', float('nan')):.4f}",
                acc=f"{metrics.get('acc', float('nan')):.3f}",
                **({f"{self.unit}/s": f"{tp:.0f}"} if tp else {}), refresh=False)
            self.bar.refresh()

    def epoch(self, step: int, epoch: int, **metrics: Any) -> None:
        if not self.enabled:
            return
        if self.json:
            self._emit(Event.epoch, epoch=epoch, step=step, total_steps=self.total_steps, **metrics)
        elif self.bar is not None:
            self.bar.write(f"epoch {epoch}: " + "  ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in metrics.items()))

    def end(self, status: RunStatus | str, **info: Any) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.json:
            self._emit(Event.end, total_steps=self.total_steps, status=RunStatus(status).value,
                       **info)
