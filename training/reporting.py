"""MLflow side of a training run (rank 0 only) and the end-of-run artifacts.

Layout of a run (experiment = ``recipe.experiment``, e.g. ``cifar10`` or ``imdb``)::

    params     recipe.<dotted key>, model.<config field>, data.n_train, data.n_val, ...
    tags       vit_service.recipe, vit_service.task, vit_service.objective,
               vit_service.run_dir, lineage.*, and where the initial weights came from:
               vit_service.init_kind|init_source|parent_run_id|parent_model|parent_recipe
    metrics    train/loss, train/acc, train/lr, train/throughput, train/data_time_frac,
               train/grad_norm (every log_every steps); val/loss, val/acc, val_acc, epoch
               (every epoch); val/class_acc/<class> (end). Pretraining (mae, mlm): train/loss,
               val/loss, val_loss only
    artifacts  recipe.yaml, confusion_matrix.png, per_class.json,
               attention/attention_rollout.{png,html}, model/ (the bundle as a pyfunc model);
               mae: reconstructions/mae_reconstructions.png; fine-tuning:
               lineage/init.json, lineage/parent_recipe.yaml
"""

from __future__ import annotations

import importlib.util
import io
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.evaluate import EvalResult
from training.recipes import Recipe, flatten

log = logging.getLogger(__name__)

MAX_PARAM_LEN = 500  # MLflow's limit is 6000; long values (lists) are cut for readability


class MlflowRun:
    """Start or reopen the run, log params/metrics/artifacts, register the bundle."""

    def __init__(self, tracking_uri: str | None, settings: Any) -> None:
        import mlflow

        from vit_service import tracking

        self.mlflow = mlflow
        self.tracking = tracking
        self.settings = settings
        self.uri = tracking.configure(tracking_uri, settings)
        self.run_id: str | None = None

    def start(self, recipe: Recipe, run_name: str, run_id: str | None = None,
              tags: dict[str, str] | None = None) -> str:
        system_metrics = importlib.util.find_spec("psutil") is not None
        if not system_metrics:
            log.warning("psutil is not installed: MLflow system metrics are off")
        if run_id is not None:
            run = self.mlflow.start_run(run_id=run_id, log_system_metrics=system_metrics)
            log.info("resuming MLflow run %s (%s)", run_id, self.uri)
        else:
            exp_id = self.tracking.ensure_experiment(recipe.experiment, self.settings)
            run = self.mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags,
                                        log_system_metrics=system_metrics)
            log.info("MLflow run %s in experiment %r (%s)", run.info.run_id, recipe.experiment,
                     self.uri)
        self.run_id = run.info.run_id
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        clean = {k: _param_str(v) for k, v in params.items()}
        items = list(clean.items())
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self.mlflow.log_params(dict(items[i : i + 100]))

    def log_recipe(self, recipe: Recipe, model_config: dict[str, Any],
                   extra: dict[str, Any]) -> None:
        params: dict[str, Any] = dict(recipe_params(recipe))
        params.update({f"model.{k}": v for k, v in model_config.items()})
        params.update(extra)
        self.log_params(params)
        self.mlflow.log_text(recipe.to_yaml(), "recipe.yaml")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.mlflow.log_artifact(str(path), artifact_path)

    def log_eval_report(self, result: EvalResult, out_dir: Path, step: int) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log_artifact(confusion_matrix_plot(result, out_dir / "confusion_matrix.png"))
        per_class = result.per_class()
        self.mlflow.log_dict({"accuracy": result.acc, "loss": result.loss,
                              "confusion": result.confusion.tolist(), "per_class": per_class},
                             "per_class.json")
        self.log_metrics({f"val/class_acc/{r['class']}": r["recall"] for r in per_class}, step)

    def register(self, bundle_dir: Path, task: str, name: str | None,
                 promote: bool = True) -> str | None:
        """Log the bundle as the run's model; register and (``promote``) maybe move the
        champion alias. Pretrained encoders are registered without a champion: fine-tuning
        takes ``@latest`` or an explicit version."""
        version = self.tracking.log_bundle(bundle_dir, task, registered_name=name)
        if name and version:
            promoted = promote and self.tracking.promote_champion(
                name, version, lock_dir=Path(self.settings.home))
            self.mlflow.set_tag("vit_service.champion", str(promoted).lower())
            self.mlflow.set_tag("vit_service.registered", f"{name}/{version}")
            log.info("registered %s v%s%s", name, version, " (champion)" if promoted else "")
        return version

    def log_lineage(self, lineage: dict[str, Any], parent_recipe: dict[str, Any] | None) -> None:
        """Where the initial weights came from, as artifacts next to the tags."""
        import yaml

        self.mlflow.log_dict(lineage, "lineage/init.json")
        if parent_recipe:
            self.mlflow.log_text(yaml.safe_dump(parent_recipe, sort_keys=False),
                                 "lineage/parent_recipe.yaml")

    def log_dataset(self, info: Any, path: Path) -> None:
        """An uploaded data set as the run's input (MLflow's dataset record: its name, where
        it is kept, its digest; the full sha256 as a tag), so the model points to the exact
        data it saw."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset

        ds = MetaDataset(resolve_dataset_source(str(path)), name=f"{info.filename} ({info.id})",
                         digest=info.sha256[:32])  # MLflow keeps at most 36 characters
        self.mlflow.log_input(ds, context="training", tags={"sha256": info.sha256,
                                                            "dataset_id": info.id,
                                                            "kind": info.kind})

    def end(self, status: str = "FINISHED") -> None:
        if self.mlflow.active_run() is not None:
            self.mlflow.end_run(status=status)


def recipe_params(recipe: Recipe) -> dict[str, str]:
    """The ``recipe.<dotted key>`` params a run logs for ``recipe``, as MLflow stores them
    (strings, long ones cut): what a logged run is compared with to tell which recipe it ran."""
    return {f"recipe.{k}": _param_str(v) for k, v in flatten(recipe.to_dict()).items()}


def _param_str(v: Any) -> str:
    s = "null" if v is None else str(v)
    return s if len(s) <= MAX_PARAM_LEN else s[: MAX_PARAM_LEN - 3] + "..."


# --------------------------------------------------------------------------------- plots


def confusion_matrix_plot(result: EvalResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = result.confusion
    k = cm.shape[0]
    norm = cm / np.maximum(cm.sum(1, keepdims=True), 1)  # rows: share of each true class
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * k, 0.8 + 0.7 * k), dpi=110)
    ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(k), result.class_names, rotation=45, ha="right")
    ax.set_yticks(range(k), result.class_names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"validation accuracy {result.acc:.4f} (n={result.n})")
    for i in range(k):
        for j in range(k):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=7,
                    color="white" if norm[i, j] > 0.5 else "black")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def image_attention_sheet(
    images: np.ndarray,
    attn: torch.Tensor,
    grid: tuple[int, int],
    query: str,
    labels: list[int],
    probs: torch.Tensor,
    class_names: list[str],
    path: Path,
) -> Path:
    """A sheet with, per image (uint8 ``(n, H, W, 3)``), the image and its [CLS] attention
    rollout overlay; ``attn`` is ``(L, n, H, T, T)``; ``query``: the model's pooling (the row
    the rollout reads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from vit_service.attention_maps import attention_rollout, overlay_heatmap

    maps = attention_rollout(attn, grid=grid, query=query)  # (n, gh, gw)
    n = images.shape[0]
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, 2 * cols, figsize=(4.2 * cols, 2.5 * rows), dpi=110,
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(n):
        r, c = divmod(i, cols)
        img = Image.fromarray(images[i])
        over = Image.open(io.BytesIO(overlay_heatmap(img, maps[i], alpha=0.5)))
        pred = int(probs[i].argmax())
        axes[r, 2 * c].imshow(img.resize(over.size, Image.NEAREST))
        axes[r, 2 * c].set_title(f"true: {class_names[labels[i]]}", fontsize=8)
        axes[r, 2 * c + 1].imshow(over)
        axes[r, 2 * c + 1].set_title(f"pred: {class_names[pred]} ({float(probs[i, pred]):.2f})",
                                     fontsize=8, color="green" if pred == labels[i] else "red")
    fig.suptitle("[CLS] attention rollout (mean over heads, residual added)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def mae_reconstruction_sheet(
    images: np.ndarray,
    masked: np.ndarray,
    recon: np.ndarray,
    loss: float,
    mask_ratio: float,
    path: Path,
) -> Path:
    """Per image (uint8 ``(n, H, W, 3)`` each): the original, what the encoder saw (hidden
    patches grey) and the reconstruction (predicted hidden patches + the visible ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = images.shape[0]
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, 3 * cols, figsize=(1.5 * 3 * cols, 1.9 * rows), dpi=110,
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(n):
        r, c = divmod(i, cols)
        for j, (img, title) in enumerate(((images[i], "original"), (masked[i], "input"),
                                          (recon[i], "reconstruction"))):
            axes[r, 3 * c + j].imshow(img, interpolation="nearest")
            axes[r, 3 * c + j].set_title(title, fontsize=7)
    fig.suptitle(f"MAE on validation images: {mask_ratio:.0%} of patches hidden, "
                 f"loss {loss:.4f} (hidden patches only)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
