"""The end of a run: the artifacts (per-class table, attention sheet or reconstruction
picture), the model bundle, and its registration in MLflow (the champion alias for a
classifier; an encoder from pretraining is registered without one)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from training.evaluate import EvalResult, LossResult, evaluate_in_precision
from training.init import encoder_of
from vit_service.bundle import BundleMeta, save_bundle
from vit_service.precision import resolve_precision

if TYPE_CHECKING:
    from training.init import Lineage
    from training.optim import ModelEma
    from training.recipes import Recipe
    from training.reporting import MlflowRun
    from training.tasks import Task


class _Run(Protocol):
    """What publishing reads of a run (:class:`training.trainer._Run` is one): a view, so
    that this module does not import the trainer that calls it."""

    recipe: Recipe
    task: Task
    device: torch.device
    last_eval: EvalResult | LossResult | None
    run_dir: Path
    run_name: str
    step: int
    model_config: dict[str, Any]
    ema: ModelEma | None
    lineage: Lineage
    mlrun: MlflowRun | None
    register: bool

    def eval_model(self) -> nn.Module: ...

    def _set_train_mode(self) -> None: ...

log = logging.getLogger(__name__)


def publish(run: _Run, run_id: str | None) -> str | None:
    """The end of a run (rank 0): artifacts, the bundle, registration; returns the registered
    version (None without MLflow)."""
    r, res = run.recipe, run.last_eval
    assert res is not None
    model = run.eval_model()
    art_dir = run.run_dir / "artifacts"
    art_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(res, LossResult):
        return publish_encoder(run, run_id, model, res, art_dir)
    (art_dir / "per_class.txt").write_text(res.format_table() + "\n")
    attn_path = _attention_report(run, model, art_dir)
    served = served_bf16_eval(run, model)
    meta = _classifier_meta(run, res, served, run_id)
    bundle_dir = save_bundle(run.run_dir / "bundle", model, meta, run.task.tokenizer)
    if run.mlrun is None:
        return None
    run.mlrun.log_eval_report(res, art_dir, run.step)
    if served is not None:
        run.mlrun.log_metrics({"val_acc_bf16": served.acc, "val_loss_bf16": served.loss},
                              run.step)
    if attn_path is not None:
        run.mlrun.log_artifact(attn_path, "attention")
    return run.mlrun.register(bundle_dir, run.task.kind,
                               r.register_as if run.register else None)


def rehearse_publish(run: _Run) -> float:
    """Seconds the end of this run takes besides its validation passes, measured by doing its
    local part into a temporary folder: the attention or reconstruction report, the
    confusion plot, the bundle and the pyfunc model MLflow logs (nothing is logged or
    registered). Budget mode keeps this much free at the end instead of a guess, so that a
    run ends on time on a fast machine as on a slow one (:mod:`training.run_budget`). The
    first pass pays one-off costs (imports, first calls) that the real end no longer pays:
    the second one is timed."""
    _rehearse_once(run)
    t0 = time.perf_counter()
    _rehearse_once(run)
    return time.perf_counter() - t0


def _rehearse_once(run: _Run) -> None:
    from training.reporting import confusion_matrix_plot
    from vit_service.tracking import save_bundle_model

    model = run.eval_model()
    with tempfile.TemporaryDirectory(prefix="vit-service-rehearsal-") as tmp:
        out = Path(tmp)
        if run.recipe.pretraining:
            _reconstruction_report(run, model, out)
            bundle = save_bundle(out / "bundle", encoder_of(model),
                                 _encoder_meta(run, None, None), run.task.tokenizer)
        else:
            _attention_report(run, model, out)
            k = run.task.num_classes
            names = run.task.class_names
            confusion_matrix_plot(EvalResult(0.0, 0.0, np.eye(k, dtype=np.int64), names),
                                  out / "confusion_matrix.png")
            bundle = save_bundle(out / "bundle", model,
                                 _classifier_meta(run, None, None, None), run.task.tokenizer)
        if run.mlrun is not None:
            save_bundle_model(bundle, run.task.kind, out / "model")
    run._set_train_mode()


def _attention_report(run: _Run, model: nn.Module, out_dir: Path) -> Path | None:
    """The attention sheet of a few validation examples, in eval mode (no dropout of any kind,
    TTA as served); a failure is logged, never fatal."""
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            return run.task.attention_report(model, out_dir, run.recipe.attention_samples)
    except Exception:  # an artifact must not fail the run
        log.exception("attention report failed")
        return None
    finally:
        model.train(was_training)


def _reconstruction_report(run: _Run, model: nn.Module, out_dir: Path) -> Path | None:
    """Pretraining: the picture of what the model reconstructs; a failure is logged, never
    fatal."""
    try:
        n = run.recipe.mae.samples if run.recipe.mae is not None else 0
        return run.task.pretrain_report(model, out_dir, n)
    except Exception:  # an artifact must not fail the run
        log.exception("reconstruction picture failed")
        return None


def _encoder_meta(run: _Run, res: LossResult | None, run_id: str | None) -> BundleMeta:
    r = run.recipe
    spec = r.mae if r.mae is not None else r.mlm
    return BundleMeta(
        task=run.task.kind,  # type: ignore[arg-type]
        model_config=run.model_config, class_names=[],
        preprocess=run.task.bundle_preprocess(),
        extra={"recipe": r.to_dict(), "objective": r.objective,
               "pretrain": spec.model_dump(mode="json") if spec else {},
               "val_loss": res.loss if res else None, "run_id": run_id,
               "run_name": run.run_name, "step": run.step, "ema": run.ema is not None,
               "lineage": run.lineage.to_dict()},
    )


def _classifier_meta(run: _Run, res: EvalResult | None, served: EvalResult | None,
                     run_id: str | None) -> BundleMeta:
    r = run.recipe
    return BundleMeta(
        task=run.task.kind,  # type: ignore[arg-type]
        model_config=run.model_config, class_names=run.task.class_names,
        preprocess=run.task.bundle_preprocess(),
        extra={"recipe": r.to_dict(), "val_acc": res.acc if res else None,
               "val_loss": res.loss if res else None,
               **({} if served is None else {"val_acc_bf16": served.acc,
                                            "val_loss_bf16": served.loss}),
               "run_id": run_id, "run_name": run.run_name, "step": run.step,
               "ema": run.ema is not None, "objective": r.objective,
               "lineage": run.lineage.to_dict()},
    )


def records_bf16_val(run: _Run) -> bool:
    """Whether the end of this run measures the bf16 validation accuracy: a classifier trained
    on a CPU with native bf16, where the server answers in bf16 by default."""
    return not run.recipe.pretraining and resolve_precision("auto", run.device) == "bf16"


def served_bf16_eval(run: _Run, model: nn.Module) -> EvalResult | None:
    """The validation split once more, as the server runs the model on this CPU by default
    (bf16 autocast, explicit attention: :mod:`vit_service.precision`), so that the bundle and
    MLflow carry the accuracy it answers with (``val_acc_bf16``); None elsewhere."""
    if not records_bf16_val(run):
        return None
    t = time.perf_counter()
    res = evaluate_in_precision(model, run.task.val_batches(run.recipe.eval_batch_size,
                                                            all_ranks=True),
                                run.task.forward, run.task.class_names, run.device, "bf16")
    log.info("validation as served in bf16: val_acc %.4f (fp32 %.4f), %.1fs", res.acc,
             run.last_eval.acc if run.last_eval is not None else float("nan"),
             time.perf_counter() - t)
    return res


def publish_encoder(run: _Run, run_id: str | None, model: nn.Module, res: LossResult,
                    art_dir: Path) -> str | None:
    """Pretraining (mae/mlm): the reconstruction picture, and a bundle of the encoder
    alone (headless ViT / text encoder + tokenizer) registered without a champion."""
    r = run.recipe
    picture = _reconstruction_report(run, model, art_dir)
    bundle_dir = save_bundle(run.run_dir / "bundle", encoder_of(model),
                             _encoder_meta(run, res, run_id), run.task.tokenizer)
    if run.mlrun is None:
        return None
    if picture is not None:
        run.mlrun.log_artifact(picture, "reconstructions")
    return run.mlrun.register(bundle_dir, run.task.kind,
                               r.register_as if run.register else None, promote=False)
