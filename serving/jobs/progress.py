"""A job's progress, read from its log: the trainer's JSON-lines events (training.progress),
whichever executor ran it (a local process writes ``job.log`` itself; Ray's output is mirrored
into it).

:func:`read_progress` merges the events past an offset into the job's stored progress (its
epoch, step, latest metrics, end status...), and returns the offset to read from next.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from serving.jobs.model import Job
from serving.jobs.store import JobStore
from training.progress import ERROR_PREFIX, Event

TAIL_BYTES = 256 * 1024  # the most a tail of a log reads

# what Ray puts before a line a worker printed: colour codes around "(RayTrainWorker pid=12,
# ip=10.0.0.2) "; the line after it is the worker's own
_RAY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\([^)]*\)(?:\x1b\[[0-9;]*m)*\s*")


def parse_event(line: str) -> dict[str, Any] | None:
    """The progress event a log line holds, or None for any other line."""
    line = _RAY_PREFIX.sub("", line.strip(), count=1)
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def merge_progress(progress: dict[str, Any], event: dict[str, Any]) -> None:
    """Fold one event into ``progress`` (in place): counters, the latest numeric fields as
    metrics, the end status and a pre-flight failure's reason."""
    kind = event.get("event")
    if kind == Event.cluster:  # where the workers run: apart from the run's own progress
        _merge_cluster(progress.setdefault("cluster", {}), event)
        return
    progress["last_event"] = kind
    for k in ("epoch", "epochs", "step", "total_steps"):
        if k in event:
            progress[k] = event[k]
    metrics = progress.setdefault("metrics", {})
    for k, v in event.items():
        if k in ("event", "epoch", "epochs", "step", "total_steps", "mlflow_run_id", "time"):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            metrics[k] = v
    per_epoch = metrics.get("steps_per_epoch")
    if per_epoch and progress.get("total_steps"):  # a time budget re-plans the schedule
        progress["epochs"] = -(-int(progress["total_steps"]) // int(per_epoch))
    if kind == Event.end and "status" in event:
        progress["status"] = event["status"]
    if kind == Event.preflight and event.get("reason"):
        progress["preflight"] = str(event["reason"])


def _merge_cluster(cluster: dict[str, Any], event: dict[str, Any]) -> None:
    """A multi-node run's placement (training/ray_train.py): the current group's attempt and
    workers (rank -> node id, host), the latest phase and checkpointed step."""
    phase = event.get("phase")
    cluster["phase"] = phase
    attempt = event.get("attempt")
    if isinstance(attempt, int) and attempt > int(cluster.get("attempt") or 0):
        cluster["attempt"], cluster["workers"] = attempt, {}  # a new group: restarted
    if phase == "ready" and "rank" in event:
        cluster.setdefault("workers", {})[str(event["rank"])] = {
            "node_id": event.get("node_id"), "host": event.get("host")}
        cluster["nodes"] = len({w["node_id"] for w in cluster["workers"].values()})
    elif phase == "checkpoint" and "at_step" in event:
        cluster["checkpoint_step"] = event["at_step"]
    elif phase == "failed":
        cluster["error"] = str(event.get("error", ""))[-500:]


def cluster_timeline(path: Path) -> list[dict[str, Any]]:
    """The ``cluster`` events of a job's log, once each (nodes sharing one machine's log folder
    repeat each other's lines), in time order: a multi-node job's timeline."""
    seen: dict[tuple, dict[str, Any]] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                event = parse_event(line)
                if event is None or event.get("event") != Event.cluster:
                    continue
                key = (event.get("phase"), event.get("rank"), event.get("attempt"),
                       event.get("at_step"), event.get("time"))
                seen.setdefault(key, event)
    except OSError:
        return []
    return sorted(seen.values(), key=lambda e: float(e.get("time") or 0))


def read_progress(store: JobStore, job_id: str, offset: int) -> tuple[Job, int]:
    """Merge the whole lines the job's log holds past ``offset`` into its stored progress (and
    its MLflow run id). Returns the job as read before that (its state and reason are the
    ones the merge leaves unchanged) and the offset to read from next."""
    job = store.get(job_id)
    if job is None:
        raise KeyError(job_id)
    try:
        with open(job.log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return job, offset
    cut = data.rfind(b"\n") + 1  # only whole lines
    changed = False
    progress = dict(job.progress)
    run_id = job.mlflow_run_id
    for line in data[:cut].decode("utf-8", "replace").splitlines():
        event = parse_event(line)
        if event is None:
            continue
        changed = True
        run_id = event.get("mlflow_run_id") or run_id
        merge_progress(progress, event)
    if changed:
        store.update(job_id, progress=progress, mlflow_run_id=run_id)
    return job, offset + cut


def tail_lines(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of a log (reading only its end)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - TAIL_BYTES))
        out = f.read().decode("utf-8", "replace").splitlines()
    return out[-lines:] if lines > 0 else []


def failure_reason(path: Path, code: int | None) -> str:
    """Why an attempt failed: its exit code, with the trainer's own one-line error when its log
    ends with one (``error: ...``: what `vit-service train` prints for a bad recipe value or
    missing data, e.g. too few labelled texts for the n-gram teacher), so the job's ``reason``
    says what to change without reading the log."""
    for line in reversed(tail_lines(path, 20)):
        if line.startswith(ERROR_PREFIX):
            return f"exited with code {code}: {line[len(ERROR_PREFIX):].strip()[:500]}"
    return f"exited with code {code}"


def last_event(path: Path, kind: Event) -> dict[str, Any] | None:
    """The latest ``kind`` event near the end of a log."""
    for line in reversed(tail_lines(path, 200)):
        event = parse_event(line)
        if event is not None and event.get("event") == kind:
            return event
    return None
