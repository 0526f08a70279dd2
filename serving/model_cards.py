"""A card for every served model: what it is, how it was trained, how well it does.

From the loaded bundle (always): name, version, alias, recipe, parameter count, the validation
accuracy and step the bundle was saved at. From the model's MLflow run (when it has one): the
per-class precision / recall and confusion matrix (``per_class.json``, logged by the trainer at
its last evaluation), the run's wall-clock time, its planned budget and a link. MLflow is asked
once per loaded version (the card is cached by name and the source's fingerprint, which changes
iff a reload swaps the version, local bundles included); if it cannot be reached the card says so
and keeps the bundle's part (not cached, so the next view asks again).
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

from serving.model_store import LoadedModel, ModelStore
from vit_service.models import count_parameters

log = logging.getLogger(__name__)


class ModelCards:
    def __init__(self, store: ModelStore) -> None:
        self.store = store
        self._cache: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def card(self, m: LoadedModel) -> dict[str, Any]:
        """Blocking (MLflow calls): run it in a worker thread."""
        key = (m.name, m.resolved.fingerprint)  # changes iff the served version does
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        card = self._from_bundle(m)
        if m.run_id:
            try:
                card.update(self._from_run(m.run_id))
            except Exception as e:  # the registry may be down; the bundle part still holds
                log.warning("model card for %s: MLflow run %s unavailable: %s", m.name,
                            m.run_id, e)
                card["mlflow_error"] = f"{type(e).__name__}: {e}"
        if "mlflow_error" not in card:
            with self._lock:
                self._cache[key] = card
        return card

    @staticmethod
    def _from_bundle(m: LoadedModel) -> dict[str, Any]:
        extra = m.bundle.meta.extra or {}
        recipe = extra.get("recipe") or {}
        model = recipe.get("model") or {}
        return {
            "name": m.name, "version": m.version, "alias": m.alias, "task": m.task,
            "run_id": m.run_id, "run_url": m.run_url, "run_name": extra.get("run_name"),
            "recipe": recipe.get("name"), "preset": model.get("name"),
            "parameters": count_parameters(m.bundle.model, trainable_only=False),
            "val_acc": extra.get("val_acc"), "val_loss": extra.get("val_loss"),
            "precision": m.precision, "served_val_acc": m.served_val_acc,
            "relevance": m.relevance_unavailable is None,
            "relevance_unavailable": m.relevance_unavailable,
            "step": extra.get("step"), "ema": extra.get("ema"),
            "classes": m.class_names, "per_class": None, "confusion": None,
            "training_s": None, "budget_minutes": recipe.get("budget_minutes"),
        }

    def _from_run(self, run_id: str) -> dict[str, Any]:
        client = self.store.client
        run = client.get_run(run_id)
        out: dict[str, Any] = {}
        info = run.info
        if info.start_time and info.end_time:
            out["training_s"] = round((info.end_time - info.start_time) / 1000, 1)
        wall = run.data.metrics.get("budget/wall_s")
        if wall is not None:
            out["training_s"] = round(float(wall), 1)
        if "val_acc" in run.data.metrics:
            out["val_acc"] = float(run.data.metrics["val_acc"])
        with tempfile.TemporaryDirectory(prefix="vit-service-card-") as tmp:
            try:
                path = client.download_artifacts(run_id, "per_class.json", tmp)
            except Exception as e:  # an older run without the report
                log.info("run %s has no per_class.json: %s", run_id, e)
                return out
            report = json.loads(Path(path).read_text())
        out["per_class"] = report.get("per_class")
        out["confusion"] = report.get("confusion")
        return out
