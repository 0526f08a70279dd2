"""Everything a run needs before its first step, assembled by :func:`build_run`: the data
(:mod:`training.tasks`), the model with its initial weights (:mod:`training.model_setup`,
:mod:`training.init`), the optimiser, schedule, EMA and budget plan, the run's folder, progress
reporter and MLflow run. The result, :class:`RunSetup`, is a plain value: the trainer reads it
and never changes what it holds except through the objects' own methods."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training import checkpoint as ckpt_io
from training.distributed import DistInfo, broadcast_object
from training.init import (
    InitError,
    InitSource,
    Lineage,
    build_timm_model,
    check_split,
    encoder_of,
    load_encoder,
    resolve_init,
)
from training.model_setup import build_task_model, structured_init
from training.optim import BudgetPlanner, LrSchedule, ModelEma, build_optimizer
from training.progress import Progress
from training.recipes import Recipe
from training.reporting import MlflowRun
from training.resolution import ResolutionSchedule
from training.run_state import Trainables
from training.step import freeze_encoder, seed_everything
from training.tasks import Task, build_task
from vit_service.config import Settings
from vit_service.data.datasets import DatasetStore
from vit_service.data.tokenizer import TextTokenizer
from vit_service.execution import Execution, resolve_execution
from vit_service.hardware import cpu_has_native_bf16, has_cxx_compiler, machine_params
from vit_service.models import config_to_dict, count_parameters
from vit_service.models.layers import set_fused_attn

log = logging.getLogger(__name__)


@dataclass
class RunSetup:
    """The collaborators of one run."""

    recipe: Recipe
    dist: DistInfo
    task: Task
    parts: Trainables
    model_config: dict[str, Any]  # the (encoder's, when pretraining) config, as saved
    lineage: Lineage  # where the initial weights came from
    init_source: InitSource | None  # a pretrained encoder's source (None: scratch or resume)
    resolution: ResolutionSchedule | None  # progressive resizing
    execution: Execution  # the training step's autocast dtype and attention path
    steps_per_epoch: int
    warmup_steps: Callable[[int], int]  # total steps -> warm-up steps of such a schedule
    run_name: str
    run_dir: Path
    progress: Progress
    mlrun: MlflowRun | None
    register: bool  # register the model (False: only log it to the run)
    ckpt: dict[str, Any] | None  # the checkpoint being resumed
    datasets: DatasetStore  # the uploaded data sets (data.dataset=<id>)
    started_at: float  # time.monotonic() when the run's wall clock started

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def ckpt_path(self) -> Path:
        return self.run_dir / "checkpoints" / ckpt_io.LAST


def default_run_name(recipe: Recipe) -> str:
    return f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def warmup_for(recipe: Recipe, steps_per_epoch: int, total_steps: int) -> int:
    """The warm-up of a schedule of ``total_steps``: fixed steps, a fraction of the run, or
    epochs."""
    o = recipe.optim
    if o.warmup_steps is not None:
        return o.warmup_steps
    if o.warmup_fraction is not None:
        return round(o.warmup_fraction * total_steps)
    return round((o.warmup_epochs or 0.0) * steps_per_epoch)


def _initial_weights(recipe: Recipe, ckpt: dict[str, Any] | None, tracking_uri: str | None,
                     settings: Settings
                     ) -> tuple[InitSource | None, Lineage, TextTokenizer | None]:
    """Resolved before the data (a text encoder brings its tokenizer); on resume the
    checkpoint has the weights, the tokenizer and the lineage."""
    if ckpt is not None:
        tok = TextTokenizer.from_str(ckpt["tokenizer"]) if ckpt.get("tokenizer") else None
        return None, Lineage.from_dict(ckpt.get("lineage")), tok
    if recipe.init.from_ is None:
        return None, Lineage(), None
    src = resolve_init(recipe.init.from_, tracking_uri, settings)
    if recipe.task == "text" and src.tokenizer is None:
        raise InitError(f"init.from {recipe.init.from_!r} has no tokenizer: a text "
                        "encoder can only be fine-tuned with its own vocabulary")
    check_split(recipe, src.parent_recipe)
    return src, src.lineage, src.tokenizer


def _build_model(recipe: Recipe, task: Task, ckpt: dict[str, Any] | None,
                 init_source: InitSource | None, lineage: Lineage) -> tuple[nn.Module, Lineage]:
    torch.manual_seed(recipe.seed)  # identical init on every rank (DDP also broadcasts)
    model: nn.Module
    if recipe.init.timm is not None and ckpt is None:
        model, lineage = build_timm_model(recipe, task.num_classes)
    elif recipe.init.timm is not None:  # resume: timm's architecture, weights from ckpt
        from vit_service.models import build_model_from_dict

        assert ckpt is not None
        model = build_model_from_dict(ckpt["model_config"])
    else:
        model = build_task_model(recipe, task)
    if init_source is not None:
        load_encoder(encoder_of(model), init_source)
    if ckpt is None:
        structured_init(model, recipe, task)
    if recipe.freeze_encoder:
        log.info("freeze_encoder: training the head only (%d parameters)",
                 freeze_encoder(model))
    return model, lineage


def build_run(recipe: Recipe, dist: DistInfo, settings: Settings, *,
              data_dir: str | Path | None, run_name: str | None, ckpt: dict[str, Any] | None,
              tracking_uri: str | None, register: bool, mlflow_enabled: bool,
              progress: Progress | None, started_at: float) -> RunSetup:
    """Assemble a run (see the module docstring); nothing is logged to MLflow yet."""
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    device = dist.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    execution = resolve_execution("train", device, amp=recipe.amp, cpu_bf16=recipe.cpu_bf16,
                                  attention=recipe.attention, native_bf16=cpu_has_native_bf16)

    seed_everything(recipe.seed + dist.rank)
    init_source, lineage, tokenizer = _initial_weights(recipe, ckpt, tracking_uri, settings)
    t0 = time.perf_counter()
    datasets = DatasetStore(Path(settings.home) / "datasets")
    task = build_task(recipe, dist, data_dir, settings.cache_dir, tokenizer, datasets)
    log.info("data ready in %.1fs", time.perf_counter() - t0)
    model, lineage = _build_model(recipe, task, ckpt, init_source, lineage)
    set_fused_attn(model, execution.fused_attention)  # the path every step takes
    model = model.to(device)
    o = recipe.optim
    ema = ModelEma(model, o.ema_decay) if o.ema_decay else None
    optimizer = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.layer_decay,
                                fused=True, algorithm=o.optimizer)
    steps_per_epoch = task.steps_per_epoch()
    total_steps = recipe.epochs * steps_per_epoch

    def warmup(total: int) -> int:
        return warmup_for(recipe, steps_per_epoch, total)

    scheduler = LrSchedule(optimizer, o.lr, total_steps, min(warmup(total_steps), total_steps),
                           o.min_lr, o.schedule)
    resolution = None
    if recipe.augment.resolution_schedule:  # progressive resizing (validated: a ViT)
        enc = encoder_of(model).config
        resolution = ResolutionSchedule(recipe.augment.resolution_schedule,
                                        recipe.data.image_size, enc.patch_size,
                                        enc.patch_dropout)
    budget = None
    if recipe.budget_minutes is not None:
        budget = BudgetPlanner(recipe.budget_minutes * 60.0, started_at, reserve_s=0.0,
                               stages=resolution.stages if resolution is not None else None)

    if run_name is None:
        run_name = broadcast_object(default_run_name(recipe), dist)
    progress = progress or Progress(enabled=dist.is_main, unit=task.unit)
    progress.enabled = progress.enabled and dist.is_main
    mlrun = MlflowRun(tracking_uri, settings) if mlflow_enabled and dist.is_main else None
    return RunSetup(
        recipe=recipe, dist=dist, task=task,
        parts=Trainables(model, ema, optimizer, scheduler, budget),
        model_config=config_to_dict(encoder_of(model).config), lineage=lineage,
        init_source=init_source, resolution=resolution, execution=execution,
        steps_per_epoch=steps_per_epoch,
        warmup_steps=warmup, run_name=run_name, run_dir=Path(settings.home) / "runs" / run_name,
        progress=progress, mlrun=mlrun, register=register, ckpt=ckpt, datasets=datasets,
        started_at=started_at)


def train_module(model: nn.Module, dist: DistInfo, compile: bool, kind: str) -> nn.Module:
    """The module the steps run: ``model``, wrapped in DDP and compiled as asked."""
    train_model: nn.Module = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        train_model = DDP(model, device_ids=ids)
    if compile and dist.device.type == "cpu" and not has_cxx_compiler():
        log.warning("compile: TorchInductor needs a C++ compiler on the CPU (g++, c++ or "
                    "clang++; none on PATH): training eager")
    elif compile:
        # images: static shapes (a resolution schedule gets one graph per stage rather than
        # a shape-generic one); text: the length buckets vary T, so dynamo's automatic
        # dynamic shapes (one generic graph after the second length)
        train_model = torch.compile(  # type: ignore[assignment]
            train_model, dynamic=False if kind == "image" else None)
    return train_model


def run_params(s: RunSetup, total_steps: int) -> dict[str, Any]:
    """The MLflow params of a run besides its recipe and model config: the data, the schedule,
    the model's size, how it executes, and the machine it ran on."""
    model = s.parts.model
    return {"data.n_train": s.task.n_train, "data.n_val": s.task.n_val,
            "train.steps_per_epoch": s.steps_per_epoch, "train.total_steps": total_steps,
            "train.world_size": s.dist.world_size,
            "model.n_params": count_parameters(model, trainable_only=False),
            "model.n_trainable": count_parameters(model), "train.device": str(s.device),
            "train.precision": s.execution.precision,
            "train.attention": "fused" if s.execution.fused_attention else "explicit",
            **s.task.data_params(), **machine_params()}
