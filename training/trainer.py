"""The training run shared by the image and text tasks.

``train(recipe, ...)`` builds the task (data on the device), the model (from scratch - with
optional whitened patch filters or mimetic attention - or with a pretrained encoder:
``recipe.init``, see :mod:`training.init`), AdamW with weight-decay groups (optionally layer-wise
lr decay, or only the head for a frozen-encoder linear probe) and the per-update schedule
(:mod:`training.optim`: warm-up, cosine or linear decay to ``min_lr`` on the last update), an
optional EMA; runs steps (:mod:`training.step`: soft-target cross-entropy - label smoothing,
CutMix/Mixup - or, for the ``mae`` / ``mlm`` objectives, the model's own loss; gradient
clipping; bf16 autocast and ``torch.compile`` where asked); evaluates every ``eval_every``
epochs (the last pass always fp32); checkpoints
atomically; logs to MLflow; and at the end publishes (:mod:`training.publish`): the bundle, its
registration and the ``champion`` alias if it is better.

``budget_minutes``: the run is sized to the wall clock instead of ``epochs``
(:class:`training.optim.BudgetPlanner`, re-planned from the measured throughput as it goes).

Stopping: ``max_steps`` (status ``stopped``; the model is still evaluated and registered),
SIGTERM (status ``interrupted``: checkpoint at the end of the current step, MLflow run marked
KILLED, exit code 143) or SIGINT (same, exit code 130). ``resume`` continues from a checkpoint
with the same step count, optimiser, schedule, RNG states and MLflow run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training import checkpoint as ckpt_io
from training.distributed import (
    DistInfo,
    all_reduce_sum,
    any_true,
    broadcast_object,
    cleanup,
    init_distributed,
)
from training.evaluate import EvalResult, LossResult, evaluate_batches
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
from training.optim import BudgetPlanner, LrSchedule, ModelEma, build_optimizer
from training.progress import Progress
from training.recipes import Recipe, apply_overrides, validate_recipe
from training.resolution import ResolutionSchedule
from training.run_budget import BUDGET_MARGIN, PUBLISH_RESERVE_S, BudgetedRun
from training.run_state import CheckpointedRun
from training.signals import StopFlag
from training.step import (
    StepWindow,
    freeze_encoder,
    seed_everything,
    train_step,
    training_precision,
    use_fused_attention,
)
from training.tasks import Task, build_task
from vit_service.config import Settings, get_settings
from vit_service.data.tokenizer import TextTokenizer
from vit_service.hardware import has_cxx_compiler
from vit_service.models import config_to_dict, count_parameters
from vit_service.models.layers import attention_path, set_fused_attn
from vit_service.precision import autocast_dtype, resolve_precision

log = logging.getLogger(__name__)

WHITEN_IMAGES = 5000  # training images whose patches set init.whiten_patches


# ----------------------------------------------------------------------------- the run


@dataclass
class TrainResult:
    status: str  # finished | stopped (max_steps) | interrupted (signal)
    step: int
    epoch: int
    run_name: str
    run_dir: Path
    val_acc: float | None = None  # None for the pretraining objectives
    val_loss: float | None = None
    mlflow_run_id: str | None = None
    registered_version: str | None = None
    checkpoint: Path | None = None
    exit_code: int = 0


def _default_run_name(recipe: Recipe) -> str:
    return f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def train(recipe: Recipe, **options: Any) -> TrainResult:
    """Train ``recipe`` end to end (see the module docstring); ``options`` are
    :func:`prepare_run`'s keywords. With ``resume`` (a checkpoint path, a run folder or
    ``auto``) the checkpoint's recipe is used, with ``resume_overrides`` (execution settings:
    ``max_steps``, ``device``, ``threads``...) applied; a run stopped by ``max_steps``
    continues past it only with a new ``max_steps`` (``None``: to the end)."""
    try:
        return prepare_run(recipe, **options).run()
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
) -> _Run:
    """Everything :func:`train` does before the first step (data, the model with its initial
    weights, the optimiser); ``.run()`` trains. Nothing is logged to MLflow before that, so the
    initial model can be inspected (``.model``, ``.lineage``). ``started_at``
    (``time.monotonic()`` seconds) is when the run's wall clock starts for ``budget_minutes``
    (the CLI passes its process's start; default: now)."""
    started_at = time.monotonic() if started_at is None else started_at
    settings = settings or get_settings()
    runs_dir = Path(settings.home) / "runs"
    ckpt: dict[str, Any] | None = None
    if resume is not None:
        path = ckpt_io.find_checkpoint(runs_dir, str(resume), run_name, recipe.name)
        ckpt = ckpt_io.load_checkpoint(path)
        recipe = validate_recipe(apply_overrides(ckpt["recipe"], resume_overrides or {}))
        run_name = ckpt["run_name"]
        log.info("resuming %s from %s (step %d)", run_name, path, ckpt["step"])

    dist = init_distributed(recipe.device)
    if not dist.is_main:  # rank 0 alone reports
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    return _Run(recipe, dist, settings, data_dir, run_name, ckpt, tracking_uri, register,
                mlflow_enabled, progress, started_at)


class _Run(BudgetedRun, CheckpointedRun):
    """One training run: set up in ``__init__`` (:func:`prepare_run`), trained by :meth:`run`;
    the budget-mode steps and the checkpoint state are its mixins'."""

    def __init__(self, recipe: Recipe, dist: DistInfo, settings: Settings,
                 data_dir: str | Path | None, run_name: str | None,
                 ckpt: dict[str, Any] | None, tracking_uri: str | None, register: bool,
                 mlflow_enabled: bool, progress: Progress | None,
                 started_at: float | None = None) -> None:
        self.recipe, self.dist, self.settings, self.ckpt = recipe, dist, settings, ckpt
        self.register, self.device = register, dist.device
        if recipe.threads:
            torch.set_num_threads(recipe.threads)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.set_float32_matmul_precision("high")
        self.amp_dtype, self.eval_amp_dtype = training_precision(recipe, self.device)

        seed_everything(recipe.seed + dist.rank)
        # initial weights: resolved before the data (a text encoder brings its tokenizer);
        # on resume the checkpoint has the weights, the tokenizer and the lineage
        self.init_source: InitSource | None = None
        self.lineage = Lineage()
        tokenizer: TextTokenizer | None = None
        if ckpt is not None:
            self.lineage = Lineage.from_dict(ckpt.get("lineage"))
            if ckpt.get("tokenizer"):
                tokenizer = TextTokenizer.from_str(ckpt["tokenizer"])
        elif recipe.init.from_ is not None:
            self.init_source = resolve_init(recipe.init.from_, tracking_uri, settings)
            self.lineage = self.init_source.lineage
            tokenizer = self.init_source.tokenizer
            if recipe.task == "text" and tokenizer is None:
                raise InitError(f"init.from {recipe.init.from_!r} has no tokenizer: a text "
                                "encoder can only be fine-tuned with its own vocabulary")
            check_split(recipe, self.init_source.parent_recipe)
        t0 = time.perf_counter()
        self.task: Task = build_task(recipe, dist, data_dir, settings.cache_dir, tokenizer)
        log.info("data ready in %.1fs", time.perf_counter() - t0)
        torch.manual_seed(recipe.seed)  # identical init on every rank (DDP also broadcasts)
        model: nn.Module
        if recipe.init.timm is not None and ckpt is None:
            model, self.lineage = build_timm_model(recipe, self.task.num_classes)
        elif recipe.init.timm is not None:  # resume: timm's architecture, weights from ckpt
            from vit_service.models import build_model_from_dict

            assert ckpt is not None
            model = build_model_from_dict(ckpt["model_config"])
        else:
            model = self.task.build_model()
        if self.init_source is not None:
            load_encoder(encoder_of(model), self.init_source)
        if ckpt is None:
            self._structured_init(model)
        if recipe.freeze_encoder:
            log.info("freeze_encoder: training the head only (%d parameters)",
                     freeze_encoder(model))
        self.fused_attn = use_fused_attention(recipe.attention, self.device, self.amp_dtype)
        set_fused_attn(model, self.fused_attn)
        self.model = model.to(self.device)
        self.model_config = config_to_dict(encoder_of(self.model).config)
        o = recipe.optim
        self.ema = ModelEma(self.model, o.ema_decay) if o.ema_decay else None
        self.optimizer = build_optimizer(self.model, o.lr, o.weight_decay, o.betas, o.eps,
                                         o.layer_decay, fused=True)
        self.steps_per_epoch = self.task.steps_per_epoch()
        self.total_steps = recipe.epochs * self.steps_per_epoch
        warmup = self._warmup_steps(self.total_steps)
        self.scheduler = LrSchedule(self.optimizer, o.lr, self.total_steps,
                                    min(warmup, self.total_steps), o.min_lr, o.schedule)
        self.resolution: ResolutionSchedule | None = None
        if recipe.augment.resolution_schedule:  # progressive resizing (validated: a ViT)
            enc = encoder_of(self.model).config
            self.resolution = ResolutionSchedule(recipe.augment.resolution_schedule,
                                                 recipe.data.image_size, enc.patch_size,
                                                 enc.patch_dropout)
        # budget mode: the planner re-sizes total_steps from the measured throughput
        self.budget: BudgetPlanner | None = None
        if recipe.budget_minutes is not None:
            self.budget = BudgetPlanner(
                recipe.budget_minutes * 60.0, started_at or time.monotonic(),
                reserve_s=0.0,
                stages=self.resolution.stages if self.resolution is not None else None)
            # a guess until _budget_probe measures the end (training/run_budget.py)
            self.budget.keep_for_end(0.0, PUBLISH_RESERVE_S, BUDGET_MARGIN)
        self._budget_logged = False
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.last_eval: EvalResult | LossResult | None = None
        self.last_eval_step = -1
        self._saved_step = -1

        if run_name is None:
            run_name = broadcast_object(_default_run_name(recipe), dist)
        self.run_name = run_name
        self.run_dir = Path(settings.home) / "runs" / run_name
        self.ckpt_path = self.run_dir / "checkpoints" / ckpt_io.LAST
        self.progress = progress or Progress(enabled=dist.is_main, unit=self.task.unit)
        self.progress.enabled = self.progress.enabled and dist.is_main
        self.mlrun = None
        if mlflow_enabled and dist.is_main:
            from training.reporting import MlflowRun

            self.mlrun = MlflowRun(tracking_uri, settings)
        self.stop = StopFlag()

    # ------------------------------------------------------------------ set-up

    def _warmup_steps(self, total_steps: int) -> int:
        o = self.recipe.optim
        if o.warmup_steps is not None:
            return o.warmup_steps
        if o.warmup_fraction is not None:
            return round(o.warmup_fraction * total_steps)
        return round((o.warmup_epochs or 0.0) * self.steps_per_epoch)

    def _structured_init(self, model: nn.Module) -> None:
        """``init.whiten_patches`` / ``init.mimetic`` on a model trained from scratch."""
        from vit_service.models.initializers import mimetic_init_, whiten_patch_embed_

        spec, enc = self.recipe.init, encoder_of(model)
        if spec.mimetic:
            g = torch.Generator().manual_seed(self.recipe.seed)
            log.info("mimetic attention init: %d layers", mimetic_init_(enc, generator=g))
        if spec.whiten_patches:
            images = self.task.sample_train_images(WHITEN_IMAGES)  # type: ignore[attr-defined]
            whiten_patch_embed_(enc, images.cpu())

    def _start_tracking(self) -> str | None:
        r = self.recipe
        run_id = self.ckpt.get("mlflow_run_id") if self.ckpt else None
        if self.mlrun is not None:
            tags = {"vit_service.recipe": r.name, "vit_service.task": r.task,
                    "vit_service.objective": r.objective,
                    "vit_service.run_dir": str(self.run_dir.resolve()), **self.lineage.tags()}
            new = run_id is None
            run_id = self.mlrun.start(r, self.run_name, run_id, tags)
            if new:
                self.mlrun.log_recipe(r, self.model_config, {
                    "data.n_train": self.task.n_train, "data.n_val": self.task.n_val,
                    "train.steps_per_epoch": self.steps_per_epoch,
                    "train.total_steps": self.total_steps,
                    "train.world_size": self.dist.world_size,
                    "model.n_params": count_parameters(self.model, trainable_only=False),
                    "model.n_trainable": count_parameters(self.model),
                    "train.device": str(self.device),
                    "train.precision": "bf16" if self.amp_dtype else "fp32",
                    "train.attention": "fused" if self.fused_attn else "explicit",
                    # what the champion check compares: scores count only on the same split
                    self.mlrun.tracking.SPLIT_PARAM: self.task.val_fingerprint()})
                if self.lineage.init != "scratch":
                    self.mlrun.log_lineage(self.lineage.to_dict(), self.init_source.parent_recipe
                                           if self.init_source else None)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / ckpt_io.RUN_INFO).write_text(json.dumps(
                {"recipe": r.name, "run_name": self.run_name, "mlflow_run_id": run_id}))
            (self.run_dir / "recipe.yaml").write_text(r.to_yaml())
        return run_id

    # ------------------------------------------------------------------ loop

    def eval_model(self) -> nn.Module:
        return self.ema.module if self.ema is not None else self.model

    def evaluate(self, final: bool = True) -> EvalResult | LossResult:
        """A validation pass; ``final=False`` (an intermediate one, for the curve) runs in the
        served precision when the recipe says ``val_precision: served``."""
        reduce = (lambda t: all_reduce_sum(t, self.dist)) if self.dist.enabled else None
        res: EvalResult | LossResult
        served = (resolve_precision("auto", self.device)
                  if not final and self.recipe.val_precision == "served" else "fp32")
        if self.recipe.pretraining:
            with torch.autocast(self.device.type, dtype=self.eval_amp_dtype or torch.bfloat16,
                                enabled=self.eval_amp_dtype is not None):
                res = self.task.pretrain_eval(self.eval_model(), self.recipe.eval_batch_size,
                                              reduce)
        else:
            batches = self.task.val_batches(self.recipe.eval_batch_size)
            model = self.eval_model()
            # fp32: no weights needed, fused (the CPU's explicit path measured 0.7x for the
            # flip-TTA validation forward); served bf16: autocast on the explicit path, as served
            fused = served == "fp32"
            dtype = self.eval_amp_dtype if fused else autocast_dtype(served)
            with attention_path(model, fused=fused):
                res = evaluate_batches(model, batches, self.task.forward,
                                       self.task.class_names, self.device, dtype, reduce)
        self.last_eval, self.last_eval_step = res, self.step
        self._set_train_mode()
        return res

    def _set_train_mode(self) -> None:
        """Training mode; with a frozen encoder, only the head (no dropout in the encoder)."""
        self.model.train()
        if self.recipe.freeze_encoder:
            for name, child in self.model.named_children():
                if name not in ("head", "head_drop"):
                    child.eval()

    @staticmethod
    def _val_metrics(res: EvalResult | LossResult) -> dict[str, float]:
        if res.acc is None:
            return {"val/loss": res.loss, "val_loss": res.loss}
        return {"val/loss": res.loss, "val/acc": res.acc, "val_acc": res.acc}

    def run(self) -> TrainResult:
        """Train with this process's log records also appended to ``<run dir>/train.log``."""
        handler = None
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(self.run_dir / "train.log")
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger().addHandler(handler)
        try:
            return self._run()
        finally:
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()

    def _run(self) -> TrainResult:
        r = self.recipe
        run_id = self._start_tracking()
        if self.ckpt is not None:
            self._load_state(self.ckpt)
            if self.step >= self.total_steps:
                log.info("run %s already finished; nothing to do", self.run_name)
                if self.mlrun is not None:
                    self.mlrun.end()
                return TrainResult("finished", self.step, self.epoch, self.run_name,
                                   self.run_dir, mlflow_run_id=run_id,
                                   checkpoint=self.ckpt_path)
        n_params = count_parameters(self.model)
        log.info("model %s: %.2fM params; %d steps/epoch x %d epochs = %d steps; batch %d on "
                 "%s x%d%s", r.model.name, n_params / 1e6, self.steps_per_epoch, r.epochs,
                 self.total_steps, r.batch_size, self.device, self.dist.world_size,
                 " (bf16)" if self.amp_dtype else "")

        train_model: nn.Module = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            train_model = DDP(self.model, device_ids=ids)
        if r.compile and self.device.type == "cpu" and not has_cxx_compiler():
            log.warning("compile: TorchInductor needs a C++ compiler on the CPU (g++, c++ or "
                        "clang++; none on PATH): training eager")
        elif r.compile:
            # images: static shapes (a resolution schedule gets one graph per stage rather than
            # a shape-generic one); text: the length buckets vary T, so dynamo's automatic
            # dynamic shapes (one generic graph after the second length)
            train_model = torch.compile(  # type: ignore[assignment]
                train_model, dynamic=False if self.task.kind == "image" else None)

        self.progress.start(self.total_steps, step=self.step, mlflow_run_id=run_id,
                            run_name=self.run_name, run_dir=str(self.run_dir),
                            epochs=r.epochs, steps_per_epoch=self.steps_per_epoch)
        self.stop.install()
        status = "finished"
        try:
            status = self._loop(train_model, run_id)
        finally:
            self.stop.restore()
        return self._finish(status, run_id)

    def _loop(self, train_model: nn.Module, run_id: str | None) -> str:
        r = self.recipe
        win = StepWindow(has_acc=not r.pretraining)
        self._set_train_mode()
        if self.budget is not None:
            self._budget_probe()
        while self.step < self.total_steps:
            t_epoch = time.perf_counter()
            while self.batch_in_epoch < self.steps_per_epoch and self.step < self.total_steps:
                if self._at_max_steps():
                    return "stopped"
                if any_true(self.stop.signum is not None, self.dist):
                    return "interrupted"
                t0 = time.perf_counter()
                size = None
                if self.resolution is not None:
                    if (self.resolution.advance(self.step, self.total_steps)
                            and self.mlrun is not None):
                        self.mlrun.log_metrics({"train/resolution": self.resolution.size},
                                               self.step)
                    size = self.resolution.size
                batch = self.task.train_batch(self.epoch, self.batch_in_epoch, size)
                t_data = time.perf_counter() - t0
                lr = self.scheduler.apply()
                loss, logits, gnorm = train_step(train_model, self.model, self.task, batch,
                                                 self.optimizer, r.optim.grad_clip,
                                                 self.amp_dtype)
                self.scheduler.step()
                if self.ema is not None:
                    self.ema.update(self.model)
                self.step += 1
                self.batch_in_epoch += 1
                correct = (0.0 if logits is None or batch.targets is None else
                           (logits.argmax(-1) == batch.targets.argmax(-1)).sum())
                win.add(loss.detach(), correct, batch, gnorm, t_data, time.perf_counter() - t0)
                if self.budget is not None:
                    self._budget_replan()
                if self.step % r.log_every == 0 or self.step in (r.max_steps,
                                                                 self.total_steps):
                    self._log_window(win, lr)
            if self.batch_in_epoch < self.steps_per_epoch:
                break  # budget mode: the plan ends mid-epoch (evaluated in _finish)
            self._end_epoch(t_epoch, run_id)
            win.reset()  # keep evaluation and checkpointing out of the throughput window
        return "finished"

    def _at_max_steps(self) -> bool:
        return self.recipe.max_steps is not None and self.step >= self.recipe.max_steps

    def _end_epoch(self, t_epoch: float, run_id: str | None) -> None:
        r = self.recipe
        if self.budget is not None:
            self.budget.pause()
        self.epoch += 1
        self.batch_in_epoch = 0
        done = self.step >= self.total_steps
        res = None
        if self.epoch % r.eval_every == 0 or done:
            t_eval = time.perf_counter()
            # the run's last pass (the schedule's end, or max_steps) is the fp32 one; a run
            # that ends mid-epoch gets its fp32 pass in _finish
            res = self.evaluate(final=done or self._at_max_steps())
            if self.budget is not None:  # what one evaluation costs, for the plan
                self.budget.eval_s = time.perf_counter() - t_eval
        metrics = {**(self._val_metrics(res) if res is not None else {}), "epoch": self.epoch,
                   "time/epoch_s": time.perf_counter() - t_epoch}
        if self.mlrun is not None:
            self.mlrun.log_metrics(metrics, self.step)
        val = {} if res is None else {"val_loss": res.loss, "val_acc": res.acc}
        self.progress.epoch(self.step, self.epoch - 1, **val,
                            epoch_time_s=metrics["time/epoch_s"])
        log.info("epoch %d%s step %d%s (%.0fs)", self.epoch,
                 "" if self.budget is not None else f"/{r.epochs}", self.step,
                 "" if res is None else f": val_loss {res.loss:.4f}"
                 + ("" if res.acc is None else f" val_acc {res.acc:.4f}"),
                 metrics["time/epoch_s"])
        if self.epoch % r.checkpoint_every == 0 or done:
            self._save("finished" if done else "running", run_id)
        if self.budget is not None:
            self.budget.resume()

    def _log_window(self, win: StepWindow, lr: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        m = win.flush(self.dist.world_size)
        if m is None:
            return
        m["lr"] = lr
        if self.mlrun is not None:
            self.mlrun.log_metrics({f"train/{k}": v for k, v in m.items()}, self.step)
        self.progress.step(self.step, self.epoch, **m)

    # ------------------------------------------------------------------ end of run

    def _finish(self, status: str, run_id: str | None) -> TrainResult:
        t_end = time.monotonic()  # training is over: what follows is the end the plan kept
        exit_code = 0
        if status == "interrupted":
            exit_code = self.stop.exit_code
        if self._saved_step != self.step or status != "finished":
            self._save("finished" if status == "finished" else status, run_id)
        version = None
        if status != "interrupted" and self.last_eval_step != self.step:
            res = self.evaluate()  # stopped mid-epoch: evaluate where we are
            if self.mlrun is not None:
                self.mlrun.log_metrics(self._val_metrics(res), self.step)
        if self.dist.is_main and status != "interrupted" and self.last_eval is not None:
            version = self._publish(run_id)
        res = self.last_eval
        if self.budget is not None:
            self._budget_report(status, time.monotonic() - t_end)
        self.progress.end(status=status, step=self.step, epoch=self.epoch,
                          val_acc=res.acc if res else None, val_loss=res.loss if res else None,
                          registered_version=version, checkpoint=str(self.ckpt_path),
                          run_dir=str(self.run_dir), exit_code=exit_code)
        if self.mlrun is not None:
            self.mlrun.end("KILLED" if status == "interrupted" else "FINISHED")
        log.info("run %s %s at step %d%s", self.run_name, status, self.step,
                 "" if res is None else f" (val_acc {res.acc:.4f})" if res.acc is not None
                 else f" (val_loss {res.loss:.4f})")
        return TrainResult(status, self.step, self.epoch, self.run_name, self.run_dir,
                           res.acc if res else None, res.loss if res else None, run_id, version,
                           self.ckpt_path, exit_code)

    def _budget_report(self, status: str, end_s: float) -> None:
        """How the run kept its budget, in the log and in MLflow; a run that ended early says
        why (``budget_underrun_reason``)."""
        assert self.budget is not None
        b = self.budget
        wall = time.monotonic() - b.start
        log.info("budget: %d steps in %.1fs of a %.0fs budget (%+.1f%%); the end took %.1fs "
                 "(%.1fs kept for it)", self.step, wall, b.budget_s,
                 100 * (wall / b.budget_s - 1), end_s, b.final_eval_s + b.publish_s)
        if self.recipe.max_steps is not None and self.step >= self.recipe.max_steps:
            status = "stopped by max_steps"
        reason = b.underrun_reason(wall, status, end_s)
        if reason is not None:
            log.warning("budget underrun: %s", reason)
        if self.mlrun is not None:
            self.mlrun.log_metrics({"budget/wall_s": wall, "budget/steps": self.step,
                                    "budget/epochs": self.step / self.steps_per_epoch,
                                    "budget/end_s": end_s}, self.step)
            if reason is not None:
                self.mlrun.log_params({"budget_underrun_reason": reason})

    def _publish(self, run_id: str | None) -> str | None:
        """Artifacts, bundle, registration (rank 0): :mod:`training.publish`."""
        from training.publish import publish

        return publish(self, run_id)
