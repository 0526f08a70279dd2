"""Request and response models of the jobs API."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from serving.jobs.store import JobRecord, JobState

Scalar = bool | int | float | str


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recipe: str = Field(
        ..., examples=["cifar10-vit-cpu"], description="a name from GET /v1/recipes"
    )
    overrides: dict[str, Scalar] = Field(
        default_factory=dict, examples=[{"epochs": 2, "model.pos_encoding": "learned"}],
        description="dotted recipe keys -> values, validated against the recipe's schema",
    )
    name: str = Field("", max_length=200, description="a label for people")
    nprocs: int = Field(1, ge=1, description="processes (torchrun/DDP) for this job")


class JobProgress(BaseModel):
    epoch: int | None = None
    epochs: int | None = None
    step: int | None = None
    total_steps: int | None = None
    last_event: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict, description="latest values")


class Job(BaseModel):
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
    progress: JobProgress
    mlflow_run_id: str | None
    mlflow_run_url: str | None = Field(None, description="the run in the MLflow UI")
    executor: str | None = Field(None, description="where the current attempt runs (local | "
                                 "ray), once that executor accepted it")

    @classmethod
    def from_record(cls, r: JobRecord, mlflow_ui_url: str | None) -> Job:
        url = None
        if r.mlflow_run_id and mlflow_ui_url:
            url = f"{mlflow_ui_url.rstrip('/')}/#/runs/{r.mlflow_run_id}"
        p = r.progress
        progress = JobProgress(
            epoch=p.get("epoch"), epochs=p.get("epochs"), step=p.get("step"),
            total_steps=p.get("total_steps"), last_event=p.get("last_event"),
            metrics={k: float(v) for k, v in p.get("metrics", {}).items()},
        )
        # the public fields are a subset of the record's (pid, run_dir... stay internal)
        public = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)
                  if f.name in cls.model_fields}
        return cls(**public | {"progress": progress, "mlflow_run_url": url})


class JobList(BaseModel):
    jobs: list[Job]


class JobLogs(BaseModel):
    id: str
    lines: list[str]


class JobMetrics(BaseModel):
    """Metric series of a job, read from its progress log (bounded: ``max_points`` each)."""

    id: str
    series: dict[str, list[tuple[float, float]]] = Field(
        description="name -> [[step, value], ...] in step order: loss, lr, acc, grad_norm, "
        "throughput (training steps), val_acc, val_loss (evaluations)")
    points: int = Field(description="points in the log, before downsampling")
    downsampled: bool
    step: int | None = None
    total_steps: int | None = None
    eta_s: float | None = Field(None, description="the trainer's latest estimate, 0 when done")


class Recipe(BaseModel):
    name: str
    description: str


class RecipeList(BaseModel):
    recipes: list[Recipe]
