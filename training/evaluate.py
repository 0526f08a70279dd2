"""Evaluation: loss, accuracy, confusion matrix and per-class metrics of a model on a split.

Used at the end of each epoch by the trainer (sharded over DDP ranks, confusion matrices summed)
and by ``vit-service evaluate MODEL --split val|test`` on a saved bundle.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit_service.data.tokenized import length_sorted_batches
from vit_service.execution import Execution, Precision, resolve_execution
from vit_service.tta import predict

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    loss: float
    acc: float
    confusion: np.ndarray  # (K, K) int64, rows = true class, columns = predicted
    class_names: list[str]

    @property
    def n(self) -> int:
        return int(self.confusion.sum())

    def per_class(self) -> list[dict[str, Any]]:
        """Per class: support, precision, recall (= per-class accuracy), F1."""
        cm = self.confusion
        tp = np.diag(cm).astype(float)
        support, predicted = cm.sum(1), cm.sum(0)
        rows = []
        for k, name in enumerate(self.class_names):
            p = tp[k] / predicted[k] if predicted[k] else 0.0
            r = tp[k] / support[k] if support[k] else 0.0
            f1 = 2 * p * r / (p + r) if p + r else 0.0
            rows.append({"class": name, "support": int(support[k]), "precision": p,
                         "recall": r, "f1": f1})
        return rows

    def format_table(self) -> str:
        lines = [f"accuracy {self.acc:.4f} on {self.n} examples (loss {self.loss:.4f})", "",
                 f"{'class':<14}{'support':>9}{'precision':>11}{'recall/acc':>12}{'f1':>8}"]
        for r in self.per_class():
            lines.append(f"{r['class']:<14}{r['support']:>9d}{r['precision']:>11.4f}"
                         f"{r['recall']:>12.4f}{r['f1']:>8.4f}")
        return "\n".join(lines)


@dataclass
class LossResult:
    """Validation of a pretraining objective (mae / mlm): its loss, no accuracy."""

    loss: float
    n: int
    acc: None = None


@torch.no_grad()
def evaluate_batches(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable[[nn.Module, Any], Tensor],
    class_names: list[str],
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> EvalResult:
    """Run ``forward(model, batch)`` over ``batches`` (objects with ``.labels``); ``reduce``
    sums the ``(K*K + 1)`` statistics across DDP ranks when given."""
    was_training = model.training
    model.eval()
    K = len(class_names)
    cm = torch.zeros(K * K, dtype=torch.float64, device=device)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    for batch in batches:
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = forward(model, batch)
        y = batch.labels
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").double()
        pred = logits.argmax(-1)
        cm += torch.bincount(y * K + pred, minlength=K * K).double()
    stats = torch.cat([cm, loss_sum])
    if reduce is not None:
        stats = reduce(stats)
    model.train(was_training)
    confusion = stats[:-1].round().long().view(K, K).cpu().numpy()
    n = max(1, int(confusion.sum()))
    return EvalResult(loss=float(stats[-1]) / n, acc=float(np.trace(confusion)) / n,
                      confusion=confusion, class_names=list(class_names))


# ------------------------------------------------------------------------------ saved models


def evaluate_bundle(
    model_ref: str,
    split: str,
    data_dir: str | Path | None,
    cache_dir: str | Path | None = None,
    batch_size: int = 512,
    device: str = "cpu",
    precision: str = "fp32",
) -> EvalResult:
    """Evaluate a bundle folder or a registered model (``name``, ``models:/...``) on ``val``
    (the training run's deterministic split, rebuilt from the recipe stored in the bundle) or
    ``test`` (when the data has one; else :class:`DataNotFoundError`), in ``precision``
    (``fp32``, ``bf16`` or ``auto``: :mod:`vit_service.precision`, as the server runs it)."""
    from vit_service.bundle import load_bundle

    if split not in ("val", "test"):
        raise ValueError(f"split must be val or test, got {split!r}")
    with tempfile.TemporaryDirectory(prefix="vit-service-eval-") as tmp:
        b = load_bundle(_bundle_dir(model_ref, tmp), device=device)  # fully read: tmp can go
    if not b.meta.class_names:
        raise ValueError(f"a pretrained encoder (objective "
                         f"{(b.meta.extra or {}).get('objective', '?')}), not a classifier: "
                         "fine-tune it first (init.from)")
    data = ((b.meta.extra or {}).get("recipe") or {}).get("data", {})
    source_split = "train" if split == "val" else "test"
    dev = torch.device(device)
    p = b.meta.preprocess

    def val_rows(labels: np.ndarray) -> np.ndarray:
        return bundle_val_rows(b.meta, labels) if split == "val" else np.arange(len(labels))

    if b.meta.task == "image":
        from vit_service.data import load_cifar10, load_image_folder_train

        if data.get("dataset") == "imagefolder":
            if split != "val":
                raise ValueError("an ImageFolder run has no test split: evaluate with "
                                 "--split val")
            ds = load_image_folder_train(data["path"], int(p["image_size"]), cache_dir)
        else:
            ds = load_cifar10(data_dir, source_split, image_size=int(p["image_size"]),
                              cache_dir=cache_dir)
        rows = val_rows(ds.labels)
        mean, std = torch.tensor(p["mean"], device=dev), torch.tensor(p["std"], device=dev)

        def batches() -> Iterable[_B]:
            for s in range(0, len(rows), batch_size):
                r = rows[s : s + batch_size]
                x = torch.from_numpy(ds.images[r]).to(dev).permute(0, 3, 1, 2)  # (B, 3, H, W)
                x = ((x.float() / 255) - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
                yield _B((x,), torch.from_numpy(ds.labels[r]).to(dev))
    else:
        from vit_service.data import load_imdb

        tds = load_imdb(data_dir, source_split, cache_dir=cache_dir)
        labels = np.asarray(tds.labels)
        rows = val_rows(labels)
        ids, lengths = b.tokenizer.encode_to_arrays([tds.texts[i] for i in rows],
                                                    int(p["max_len"]),
                                                    truncation=p.get("truncation", "head"))

        def batches() -> Iterable[_B]:
            for o, x, mask in length_sorted_batches(ids, lengths, batch_size):
                yield _B((x.to(dev), mask.to(dev)), torch.from_numpy(labels[rows[o]]).to(dev))

    execution = resolve_execution("serve", dev, precision=precision)
    log.info("evaluating %s on %s (%d examples, %s)", model_ref, split, len(rows),
             execution.precision)
    return evaluate_in_precision(b.model, batches(), lambda m, bb: predict(m, *bb.inputs),
                                 b.meta.class_names, dev, execution)


def evaluate_in_precision(model: nn.Module, batches: Iterable[Any],
                          forward: Callable[[nn.Module, Any], Tensor], class_names: list[str],
                          device: torch.device, precision: Precision | Execution
                          ) -> EvalResult:
    """:func:`evaluate_batches` with the model run as the server runs it in ``precision``
    (an :class:`Execution`, or a resolved precision: bf16 autocast on the explicit attention
    path, fp32 on the fused path)."""
    ex = (precision if isinstance(precision, Execution)
          else Execution.serving(precision, device.type))
    with ex.applied(model):
        return evaluate_batches(model, batches, forward, class_names, device, ex.dtype)


def bundle_val_rows(meta: Any, labels: np.ndarray) -> np.ndarray:
    """The training run's validation rows, rebuilt from the recipe stored in a bundle's
    ``meta.extra`` (``data.val_size``, ``data.split_seed``)."""
    from vit_service.data import split_indices

    data = ((meta.extra or {}).get("recipe") or {}).get("data", {})
    if "val_size" not in data:
        raise ValueError("the bundle has no recipe (data.val_size): cannot rebuild val split")
    return split_indices(labels, int(data["val_size"]), int(data.get("split_seed", 0)),
                         None)[1]


@dataclass
class _B:
    inputs: tuple[Tensor, ...]
    labels: Tensor


def _bundle_dir(model_ref: str, tmp: str) -> Path:
    """A bundle folder as is; otherwise a registered model (``name`` -> ``@champion``,
    ``models:/name@alias``, ``models:/name/version``) downloaded from MLflow."""
    p = Path(model_ref)
    if (p / "meta.json").is_file():
        return p
    if p.exists():
        raise FileNotFoundError(f"{p} is not a model bundle (no meta.json)")
    from vit_service import tracking

    return tracking.download_bundle(tracking.resolve_model(model_ref), tmp)
