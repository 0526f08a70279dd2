"""The job: one model for the job table's rows, the manager and the API's responses.

:class:`Job` holds every column of a row; the ones that are the server's business (process ids,
the run folder, the lease) are excluded from what the API answers, and ``progress`` (the merged
progress events, :mod:`serving.jobs.progress`) is answered as :class:`JobProgress`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class JobError(Exception):
    """A request the manager refuses; ``status`` is the HTTP code the API should answer."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(str(detail))
        self.status, self.detail = status, detail


# the public part of a job's progress (a comment, not a docstring: that would be published)
class JobProgress(BaseModel):
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    total_steps: int | None = None
    last_event: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict, description="latest values")


def public_progress(progress: dict[str, Any]) -> JobProgress:
    """What the API shows of the stored progress (its end status and pre-flight reason stay
    internal)."""
    return JobProgress(
        epoch=progress.get("epoch"), epochs=progress.get("epochs"), step=progress.get("step"),
        total_steps=progress.get("total_steps"), last_event=progress.get("last_event"),
        metrics={k: float(v) for k, v in progress.get("metrics", {}).items()},
    )


def _published_schema(schema: dict[str, Any]) -> None:
    """The progress field of the API's schema is a bare reference to JobProgress, as it was
    published (the serializer would title it)."""
    schema["properties"]["progress"].pop("title", None)


def _internal(default: Any = None) -> Any:
    """A column the API never answers."""
    return Field(default, exclude=True)


# One job: a row of the job table, as the manager reads it and the API answers it (the fields
# in API order; the internal ones last). Comments, not a docstring: that would be published.
class Job(BaseModel):
    model_config = ConfigDict(json_schema_extra=_published_schema)

    id: str
    name: str
    recipe: str
    overrides: dict[str, Any]
    nprocs: int
    state: JobState
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    reason: str | None
    attempts: int
    progress: Annotated[dict[str, Any], PlainSerializer(public_progress, return_type=JobProgress)]
    mlflow_run_id: str | None
    mlflow_run_url: str | None = Field(None, description="the run in the MLflow UI")
    executor: str | None = Field(None, description="where the current attempt runs (local | "
                                 "ray), once that executor accepted it")
    priority: int = Field(0, description="higher starts first; equal ones in submission order")
    owner: str | None = Field(
        None, description="the principal (API key name) that submitted it: `default` for "
        "VIT_SERVICE_API_KEY; null for jobs from before owners were recorded")
    queue_position: int | None = Field(
        None, description="while queued: 1 = admitted next (by priority, then age)")
    waiting_for: str | None = Field(None, description="while queued: why it has not started")
    # --- internal ---------------------------------------------------------------------------
    run_dir: str = _internal(...)
    pid: int | None = _internal()
    pid_start: str | None = _internal()  # the process's start time: guards against pid reuse
    resume: bool = _internal(False)  # the next start resumes from the run's checkpoint
    # the API host running a local job, and its lease: renewed while that host follows the
    # job; another host settles the job only once the lease has expired
    host: str | None = _internal()
    heartbeat_at: datetime | None = _internal()

    @property
    def log_path(self) -> Path:
        return Path(self.run_dir) / "job.log"

    def with_run_url(self, mlflow_ui_url: str | None) -> Job:
        """The job with ``mlflow_run_url`` set, for the API's answer."""
        url = None
        if self.mlflow_run_id and mlflow_ui_url:
            url = f"{mlflow_ui_url.rstrip('/')}/#/runs/{self.mlflow_run_id}"
        return self.model_copy(update={"mlflow_run_url": url})
