"""Request and response models of the jobs API (a job itself is :class:`Job`, the one model
of :mod:`serving.jobs.model`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from serving.jobs.model import Job, JobProgress

__all__ = ["Job", "JobCreate", "JobList", "JobLogs", "JobMetrics", "JobProgress", "Recipe",
           "RecipeList"]

Scalar = bool | int | float | str | None  # null unsets an optional field (budget_minutes)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recipe: str = Field(
        ..., examples=["cifar10-vit-cpu"], description="a name from GET /v1/recipes"
    )
    overrides: dict[str, Scalar] = Field(
        default_factory=dict, examples=[{"epochs": 2, "model.pos_encoding": "learned"}],
        description="dotted recipe keys -> values, validated against the recipe's schema "
        "(null unsets an optional field, e.g. budget_minutes: train by epochs)",
    )
    name: str = Field("", max_length=200, description="a label for people")
    # strict: JSON `true` or "2" is no count (lax mode would take them as 1 and 2)
    nprocs: int = Field(1, ge=1, strict=True, description="processes (torchrun/DDP) for this job")
    priority: int = Field(0, ge=-10, le=10, strict=True, description="admission order: "
                          "higher starts first; equal priorities in submission order")


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
