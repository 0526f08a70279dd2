"""One training run end to end, as the CLI, a Ray Train worker and the tests start it:
:func:`prepare_run` assembles it (a new run, or one resumed from its checkpoint) into a
:class:`training.trainer.Trainer`, :func:`train` also runs it, after the teachers of a
self-training recipe (its first phase, each a run of its own)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, TypedDict, Unpack

from training import checkpoint as ckpt_io
from training.distributed import cleanup, init_distributed
from training.progress import Progress
from training.pseudo_labels import teacher_recipe, with_teacher
from training.recipe_parts import TEACHER
from training.recipes import Recipe, apply_overrides, validate_recipe
from training.setup import build_run, default_run_name
from training.trainer import CheckpointHook, Trainer, TrainResult
from vit_service.config import Settings, get_settings

log = logging.getLogger(__name__)


class RunOptions(TypedDict, total=False):
    """How a run is started (its recipe says what it trains): the keyword arguments of
    :func:`train` and :func:`prepare_run`, all optional."""

    data_dir: str | Path | None  # the datasets' root (default: the settings' data_dir)
    run_name: str | None  # the run's folder and MLflow name (default: recipe name + time)
    resume: str | Path | None  # a checkpoint, a run folder or "auto": continue that run
    resume_overrides: dict[str, Any] | None  # execution settings changed on resume
    tracking_uri: str | None  # MLflow (default: the settings')
    register: bool  # register the bundle as the recipe's register_as (default True)
    mlflow_enabled: bool  # False: no MLflow at all (tests, probes; default True)
    settings: Settings | None  # default: get_settings()
    progress: Progress | None  # where a job's progress is reported
    started_at: float | None  # time.monotonic() when the wall clock for budget_minutes starts
    on_checkpoint: CheckpointHook | None  # called after each checkpoint (Ray Train reports)


# what a self-training run's teachers share with it (not its name, resume, registration or hook)
_SHARED_WITH_TEACHERS = ("data_dir", "tracking_uri", "mlflow_enabled", "settings", "progress",
                         "started_at")


def _check_options(options: dict[str, Any]) -> None:
    """A misspelt option is an error, as it was when they were named parameters."""
    unknown = sorted(set(options) - set(RunOptions.__annotations__))
    if unknown:
        raise TypeError(f"unknown run options: {', '.join(unknown)}")


def train(recipe: Recipe, **options: Unpack[RunOptions]) -> TrainResult:
    """Train ``recipe`` end to end (see the module docstring and :func:`prepare_run`). With
    ``resume`` (a checkpoint path, a run folder or ``auto``) the checkpoint's recipe is used,
    with ``resume_overrides`` (execution settings: ``max_steps``, ``device``, ``threads``...)
    applied; a run stopped by ``max_steps`` continues past it only with a new ``max_steps``
    (``None``: to the end)."""
    _check_options(options)
    if options.get("resume") is None and recipe.data.pseudo_labels == TEACHER:
        # self-training's first phase: the teachers, each a run of its own, not registered
        name = options.get("run_name") or default_run_name(recipe)
        teacher_options: Any = {k: v for k, v in options.items() if k in _SHARED_WITH_TEACHERS}
        bundles = []
        for k in range(recipe.data.pseudo_teachers):
            teacher = train(teacher_recipe(recipe, k), **teacher_options, register=False,
                            run_name=f"{name}-teacher" + (f"-{k + 1}" if k else ""))
            # (the teachers' checkpoints are not handed on: a Ray Train restart resuming from
            # one would take the teacher's recipe and run name for the job's own)
            if teacher.exit_code:
                return teacher
            bundles.append(teacher.run_dir / "bundle")
        recipe = with_teacher(recipe, bundles)
    try:
        return prepare_run(recipe, **options).run()
    finally:
        cleanup()


def prepare_run(recipe: Recipe, **options: Unpack[RunOptions]) -> Trainer:
    """Everything :func:`train` does before the first step; ``.run()`` trains. Nothing is
    logged to MLflow before that, so the initial model can be inspected (``.model``,
    ``.lineage``). ``started_at`` (``time.monotonic()`` seconds) is when the run's wall clock
    starts for ``budget_minutes`` (the CLI passes its process's start; default: now)."""
    _check_options(options)
    started_at = options.get("started_at")
    started_at = time.monotonic() if started_at is None else started_at
    settings = options.get("settings") or get_settings()
    run_name, resume = options.get("run_name"), options.get("resume")
    ckpt: dict[str, Any] | None = None
    if resume is not None:
        path = ckpt_io.find_checkpoint(Path(settings.home) / "runs", str(resume), run_name,
                                       recipe.name)
        ckpt = ckpt_io.load_checkpoint(path)
        recipe = validate_recipe(apply_overrides(ckpt["recipe"],
                                                 options.get("resume_overrides") or {}))
        run_name = ckpt["run_name"]
        log.info("resuming %s from %s (step %d)", run_name, path, ckpt["step"])
    dist = init_distributed(recipe.device)
    if not dist.is_main:  # rank 0 alone reports
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    return Trainer(build_run(recipe, dist, settings, data_dir=options.get("data_dir"),
                             run_name=run_name, ckpt=ckpt,
                             tracking_uri=options.get("tracking_uri"),
                             register=options.get("register", True),
                             mlflow_enabled=options.get("mlflow_enabled", True),
                             progress=options.get("progress"), started_at=started_at),
                   on_checkpoint=options.get("on_checkpoint"))
