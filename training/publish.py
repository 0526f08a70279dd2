"""The end of a run: the artifacts (per-class table, attention sheet or reconstruction
picture), the model bundle, and its registration in MLflow (the champion alias for a
classifier; an encoder from pretraining is registered without one).

Publishing reads one small value, :class:`Outcome`, that the trainer builds when training is
over; it neither trains nor evaluates.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.artifacts import attention_report, reconstruction_report
from training.evaluate import EvalResult, LossResult
from training.init import Lineage, encoder_of
from training.recipes import Recipe
from training.reporting import MlflowRun
from training.tasks import Task
from vit_service.bundle import BundleMeta, save_bundle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What a run publishes."""

    recipe: Recipe
    task: Task
    model: nn.Module  # the weights evaluated: the EMA's when there is one
    model_config: dict[str, Any]  # the (encoder's, when pretraining) config
    lineage: Lineage
    run_dir: Path
    run_name: str
    step: int
    ema: bool
    result: EvalResult | LossResult | None = None  # the last (fp32) validation; None: rehearsal
    served: EvalResult | None = None  # the same split as the server answers (bf16 CPUs)


def publish(out: Outcome, mlrun: MlflowRun | None, run_id: str | None,
            register_as: str | None) -> str | None:
    """The end of a run (rank 0): artifacts, the bundle, registration under ``register_as``
    (None: logged, not registered); returns the registered version (None without MLflow)."""
    res = out.result
    assert res is not None
    art_dir = out.run_dir / "artifacts"
    art_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(res, LossResult):
        return _publish_encoder(out, res, mlrun, run_id, register_as, art_dir)
    (art_dir / "per_class.txt").write_text(res.format_table() + "\n")
    attn_path = _attention_report(out, art_dir)
    bundle_dir = save_bundle(out.run_dir / "bundle", out.model,
                             _classifier_meta(out, res, out.served, run_id), out.task.tokenizer)
    if mlrun is None:
        return None
    mlrun.log_eval_report(res, art_dir, out.step)
    if out.served is not None:
        mlrun.log_metrics({"val_acc_bf16": out.served.acc, "val_loss_bf16": out.served.loss},
                          out.step)
    if attn_path is not None:
        mlrun.log_artifact(attn_path, "attention")
    return mlrun.register(bundle_dir, out.task.kind, register_as)


def _publish_encoder(out: Outcome, res: LossResult, mlrun: MlflowRun | None,
                     run_id: str | None, register_as: str | None, art_dir: Path) -> str | None:
    """Pretraining (mae/mlm): the reconstruction picture, and a bundle of the encoder
    alone (headless ViT / text encoder + tokenizer) registered without a champion."""
    picture = _reconstruction_report(out, art_dir)
    bundle_dir = save_bundle(out.run_dir / "bundle", encoder_of(out.model),
                             _encoder_meta(out, res, run_id), out.task.tokenizer)
    if mlrun is None:
        return None
    if picture is not None:
        mlrun.log_artifact(picture, "reconstructions")
    return mlrun.register(bundle_dir, out.task.kind, register_as, promote=False)


def rehearse_publish(out: Outcome, with_mlflow: bool) -> float:
    """Seconds the end of this run takes besides its validation passes, measured by doing its
    local part into a temporary folder: the attention or reconstruction report, the
    confusion plot, the bundle and (``with_mlflow``) the pyfunc model MLflow logs; nothing is
    logged or registered. Budget mode keeps this much free at the end instead of a guess, so
    that a run ends on time on a fast machine as on a slow one. The first pass pays one-off
    costs (imports, first calls) that the real end no longer pays: the second one is timed."""
    _rehearse_once(out, with_mlflow)
    t0 = time.perf_counter()
    _rehearse_once(out, with_mlflow)
    return time.perf_counter() - t0


def _rehearse_once(out: Outcome, with_mlflow: bool) -> None:
    from training.reporting import confusion_matrix_plot

    with tempfile.TemporaryDirectory(prefix="vit-service-rehearsal-") as tmp:
        folder = Path(tmp)
        if out.recipe.pretraining:
            _reconstruction_report(out, folder)
            bundle = save_bundle(folder / "bundle", encoder_of(out.model),
                                 _encoder_meta(out, None, None), out.task.tokenizer)
        else:
            _attention_report(out, folder)
            k, names = out.task.num_classes, out.task.class_names
            confusion_matrix_plot(EvalResult(0.0, 0.0, np.eye(k, dtype=np.int64), names),
                                  folder / "confusion_matrix.png")
            bundle = save_bundle(folder / "bundle", out.model,
                                 _classifier_meta(out, None, None, None), out.task.tokenizer)
        if with_mlflow:  # imported here: a run without MLflow needs no mlflow package
            from vit_service.tracking import save_bundle_model

            save_bundle_model(bundle, out.task.kind, folder / "model")


def _attention_report(out: Outcome, folder: Path) -> Path | None:
    """The attention sheet of a few validation examples, in eval mode (no dropout of any kind,
    TTA as served); a failure is logged, never fatal."""
    model = out.model
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            return attention_report(out.task, model, folder, out.recipe.attention_samples)
    except Exception:  # an artifact must not fail the run
        log.exception("attention report failed")
        return None
    finally:
        model.train(was_training)


def _reconstruction_report(out: Outcome, folder: Path) -> Path | None:
    """Pretraining: the picture of what the model reconstructs; a failure is logged, never
    fatal."""
    try:
        n = out.recipe.mae.samples if out.recipe.mae is not None else 0
        return reconstruction_report(out.task, out.model, folder, n)
    except Exception:  # an artifact must not fail the run
        log.exception("reconstruction picture failed")
        return None


def _common_extra(out: Outcome, run_id: str | None) -> dict[str, Any]:
    return {"recipe": out.recipe.to_dict(), "run_id": run_id, "run_name": out.run_name,
            "step": out.step, "ema": out.ema, "objective": out.recipe.objective,
            "lineage": out.lineage.to_dict()}


def _encoder_meta(out: Outcome, res: LossResult | None, run_id: str | None) -> BundleMeta:
    r = out.recipe
    spec = r.mae if r.mae is not None else r.mlm
    return BundleMeta(
        task=out.task.kind,  # type: ignore[arg-type]
        model_config=out.model_config, class_names=[],
        preprocess=out.task.bundle_preprocess(),
        extra={**_common_extra(out, run_id),
               "pretrain": spec.model_dump(mode="json") if spec else {},
               "val_loss": res.loss if res else None},
    )


def _classifier_meta(out: Outcome, res: EvalResult | None, served: EvalResult | None,
                     run_id: str | None) -> BundleMeta:
    return BundleMeta(
        task=out.task.kind,  # type: ignore[arg-type]
        model_config=out.model_config, class_names=out.task.class_names,
        preprocess=out.task.bundle_preprocess(),
        extra={**_common_extra(out, run_id), "val_acc": res.acc if res else None,
               "val_loss": res.loss if res else None,
               **({} if served is None else {"val_acc_bf16": served.acc,
                                            "val_loss_bf16": served.loss})},
    )
