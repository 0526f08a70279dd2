"""One training run end to end, as the CLI, a Ray Train worker and the tests start it:
:func:`prepare_run` assembles it (a new run, or one resumed from its checkpoint) into a
:class:`training.trainer.Trainer`, :func:`train` also runs it, after the teachers of a
self-training recipe (its first phase, each a run of its own)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from training import checkpoint as ckpt_io
from training.distributed import cleanup, init_distributed
from training.progress import Progress
from training.pseudo_labels import TEACHER, teacher_recipe, with_teacher
from training.recipes import Recipe, apply_overrides, validate_recipe
from training.setup import build_run, default_run_name
from training.trainer import CheckpointHook, Trainer, TrainResult
from vit_service.config import Settings, get_settings

log = logging.getLogger(__name__)


def train(
    recipe: Recipe,
    *,
    data_dir: str | Path | None = None,
    run_name: str | None = None,
    resume: str | Path | None = None,
    resume_overrides: dict[str, Any] | None = None,
    tracking_uri: str | None = None,
    register: bool = True,
    mlflow_enabled: bool = True,
    settings: Settings | None = None,
    progress: Progress | None = None,
    started_at: float | None = None,
    on_checkpoint: CheckpointHook | None = None,
) -> TrainResult:
    """Train ``recipe`` end to end (see the module docstring and :func:`prepare_run`). With
    ``resume`` (a checkpoint path, a run folder or ``auto``) the checkpoint's recipe is used,
    with ``resume_overrides`` (execution settings: ``max_steps``, ``device``, ``threads``...)
    applied; a run stopped by ``max_steps`` continues past it only with a new ``max_steps``
    (``None``: to the end)."""
    if resume is None and recipe.data.pseudo_labels == TEACHER:  # self-training's first phase
        name = run_name or default_run_name(recipe)
        bundles = []
        for k in range(recipe.data.pseudo_teachers):
            teacher = train(teacher_recipe(recipe, k), data_dir=data_dir,
                            run_name=f"{name}-teacher" + (f"-{k + 1}" if k else ""),
                            tracking_uri=tracking_uri,
                            register=False, mlflow_enabled=mlflow_enabled, settings=settings,
                            progress=progress, started_at=started_at)
            # (the teachers' checkpoints are not handed on: a Ray Train restart resuming from
            # one would take the teacher's recipe and run name for the job's own)
            if teacher.exit_code:
                return teacher
            bundles.append(teacher.run_dir / "bundle")
        recipe = with_teacher(recipe, bundles)
    try:
        return prepare_run(recipe, data_dir=data_dir, run_name=run_name, resume=resume,
                           resume_overrides=resume_overrides, tracking_uri=tracking_uri,
                           register=register, mlflow_enabled=mlflow_enabled, settings=settings,
                           progress=progress, started_at=started_at,
                           on_checkpoint=on_checkpoint).run()
    finally:
        cleanup()


def prepare_run(
    recipe: Recipe,
    *,
    data_dir: str | Path | None = None,
    run_name: str | None = None,
    resume: str | Path | None = None,
    resume_overrides: dict[str, Any] | None = None,
    tracking_uri: str | None = None,
    register: bool = True,
    mlflow_enabled: bool = True,
    settings: Settings | None = None,
    progress: Progress | None = None,
    started_at: float | None = None,
    on_checkpoint: CheckpointHook | None = None,
) -> Trainer:
    """Everything :func:`train` does before the first step; ``.run()`` trains. Nothing is
    logged to MLflow before that, so the initial model can be inspected (``.model``,
    ``.lineage``). ``started_at`` (``time.monotonic()`` seconds) is when the run's wall clock
    starts for ``budget_minutes`` (the CLI passes its process's start; default: now)."""
    started_at = time.monotonic() if started_at is None else started_at
    settings = settings or get_settings()
    ckpt: dict[str, Any] | None = None
    if resume is not None:
        path = ckpt_io.find_checkpoint(Path(settings.home) / "runs", str(resume), run_name,
                                       recipe.name)
        ckpt = ckpt_io.load_checkpoint(path)
        recipe = validate_recipe(apply_overrides(ckpt["recipe"], resume_overrides or {}))
        run_name = ckpt["run_name"]
        log.info("resuming %s from %s (step %d)", run_name, path, ckpt["step"])
    dist = init_distributed(recipe.device)
    if not dist.is_main:  # rank 0 alone reports
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    return Trainer(build_run(recipe, dist, settings, data_dir=data_dir, run_name=run_name,
                             ckpt=ckpt, tracking_uri=tracking_uri, register=register,
                             mlflow_enabled=mlflow_enabled, progress=progress,
                             started_at=started_at), on_checkpoint=on_checkpoint)
