"""The models being served: loaded from MLflow (by alias, version or run) or a local bundle, and
swapped for a new version without a restart.

Sources (``Settings.models``, served name -> source):

* ``models:/<name>@<alias>`` — follows the alias (e.g. ``champion``); re-resolved by the poll
  and by ``POST /v1/models/{name}/reload``, so moving the alias swaps the version;
* ``models:/<name>/<version>`` — a pinned version;
* ``runs:/<run_id>/<path>`` — the model logged by a run (immutable);
* anything else — a local folder: a bundle (``meta.json``...) or a downloaded pyfunc model;
  reloaded when its weights file changes.

A swap loads the new version completely (in a worker thread, while the old one keeps serving)
and then replaces one dict entry, which is atomic; requests already batched keep their
reference to the old version. Load failures are logged and recorded, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from mlflow import MlflowClient

from serving.compiled import Forwards, eager_forwards, trace_forwards
from serving.errors import public_message, strip_credentials
from serving.metrics import ServingMetrics
from vit_service import tracking
from vit_service.bundle import META, WEIGHTS, ModelBundle, load_bundle
from vit_service.config import Settings
from vit_service.execution import resolve_execution
from vit_service.models import set_fused_attn
from vit_service.pipeline import model_grid, model_query

log = logging.getLogger(__name__)

IMAGE_CONTENT_TYPES = ("image/png", "image/jpeg", "image/webp", "image/bmp", "image/gif",
                       "image/tiff")


class ModelLoadError(RuntimeError):
    """The source could not be resolved or loaded."""


@dataclass(frozen=True)
class Resolved:
    """Where a source points right now; ``fingerprint`` changes iff a reload is needed."""

    fingerprint: str
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None
    artifact_uri: str | None = None  # MLflow artifact URI, or None for a local folder
    local_path: Path | None = None


@dataclass(frozen=True)
class LoadedModel:
    """One loaded version; immutable, so a request can hold on to it across a swap."""

    name: str
    source: str
    bundle: ModelBundle
    resolved: Resolved
    run_url: str | None
    loaded_at: datetime
    load_seconds: float
    forwards: Forwards | None = None  # traced serving forwards (None: the eager model's)
    # why this version cannot give relevance (None: it can): found by a probe at load time, or
    # by a request whose relevance pass failed (then later requests are refused up front)
    relevance_error: dict[str, str | None] = field(
        default_factory=lambda: {"reason": None})

    @property
    def relevance_unavailable(self) -> str | None:
        return self.relevance_error["reason"]

    def mark_relevance_unavailable(self, reason: str) -> None:
        self.relevance_error["reason"] = reason

    @property
    def version(self) -> str | None:
        return self.resolved.version

    @property
    def alias(self) -> str | None:
        return self.resolved.alias

    @property
    def run_id(self) -> str | None:
        return self.resolved.run_id

    @property
    def task(self) -> str:
        return self.bundle.meta.task

    @property
    def precision(self) -> str:
        """What the served forward runs in (relevance and faithfulness too)."""
        return self.forwards.precision if self.forwards is not None else "fp32"

    @property
    def served_val_acc(self) -> float | None:
        """Validation accuracy in the precision served: the bundle's fp32 figure, or the bf16
        one its training run measured (None when it measured none: ``vit-service evaluate
        --precision bf16`` gives it)."""
        extra = self.bundle.meta.extra or {}
        return extra.get("val_acc_bf16" if self.precision == "bf16" else "val_acc")

    @property
    def class_names(self) -> list[str]:
        return self.bundle.meta.class_names

    @property
    def query(self) -> str:
        """Whose attention row the maps read: ``cls``, or ``mean`` for a mean-pooling model."""
        return model_query(self.bundle.model)

    @property
    def grid(self) -> tuple[int, int] | None:
        return model_grid(self.bundle.model)

    def info(self) -> dict[str, Any]:
        """Fields of :class:`serving.schemas.ModelInfo`."""
        return {
            "name": self.name, "task": self.task, "version": self.version, "alias": self.alias,
            "run_id": self.run_id, "source": self.source, "run_url": self.run_url,
            "loaded_at": self.loaded_at, "precision": self.precision,
        }

    def input_spec(self) -> dict[str, Any]:
        p = self.bundle.meta.preprocess
        if self.task == "image":
            return {"type": "image", "image_size": int(p["image_size"]), "mean": list(p["mean"]),
                    "std": list(p["std"]), "patch_grid": self.grid,
                    "content_types": ["multipart/form-data", *IMAGE_CONTENT_TYPES]}
        tok = self.bundle.tokenizer
        return {"type": "text", "max_len": int(p["max_len"]),
                "truncation": p.get("truncation", "head"),
                "vocab_size": tok.vocab_size if tok is not None else None}


@dataclass
class RefreshResult:
    name: str
    reloaded: bool
    previous_version: str | None
    current: LoadedModel | None


@dataclass
class _Slot:
    source: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    error: str | None = None


class ModelStore:
    """Configured models, the version currently served for each, and how to refresh them."""

    def __init__(self, settings: Settings, metrics: ServingMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.tracking_uri = settings.resolved_tracking_uri
        self._client: MlflowClient | None = None
        self._slots = {name: _Slot(src) for name, src in settings.models.items()}
        self._loaded: dict[str, LoadedModel] = {}
        # called with (name, fingerprint) after each swap: serving.workers.ModelSync.publish
        self.on_swap: Callable[[str, str], None] | None = None

    # --- lookup ---------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def is_configured(self, name: str) -> bool:
        return name in self._slots

    def get(self, name: str) -> LoadedModel | None:
        return self._loaded.get(name)

    def source(self, name: str) -> str:
        return self._slots[name].source

    def error(self, name: str) -> str | None:
        return self._slots[name].error

    def loaded(self) -> dict[str, LoadedModel]:
        return dict(self._loaded)

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            tracking.init_sqlite_store(self.tracking_uri)
            self._client = MlflowClient(tracking_uri=self.tracking_uri,
                                        registry_uri=self.tracking_uri)
        return self._client

    # --- refresh --------------------------------------------------------------------------------

    def discover(self) -> list[str]:
        """Registered models whose ``champion`` alias is set and that are not served yet,
        added as ``models:/<name>@champion`` (at most ``discover_models`` of them; 0: only
        the configured models). Returns the names added; a registry that cannot be read
        adds none."""
        cap = self.settings.discover_models
        room = cap - (len(self._slots) - len(self.settings.models))
        if cap <= 0 or room <= 0:
            return []
        try:
            found = self.client.search_registered_models(max_results=1000)
        except Exception as e:  # registry down: the configured models are still served
            log.warning("model discovery failed: %s: %s", type(e).__name__, e)
            return []
        added = []
        for rm in sorted(found, key=lambda m: m.name):
            if len(added) >= room:
                log.warning("discover_models=%d reached: %s and later names not served", cap,
                            rm.name)
                break
            if rm.name not in self._slots and "champion" in (rm.aliases or {}):
                self._slots[rm.name] = _Slot(f"models:/{rm.name}@champion")
                added.append(rm.name)
        if added:
            log.info("serving registered champions: %s", ", ".join(added))
        return added

    def add_discovered(self, name: str) -> None:
        """Serve ``name``'s champion (a model another worker discovered)."""
        if name not in self._slots:
            self._slots[name] = _Slot(f"models:/{name}@champion")

    async def load_all(self) -> None:
        """Try every configured model once (start-up), and every discovered champion;
        failures are logged, not raised."""
        await asyncio.to_thread(self.discover)
        for name in list(self._slots):
            try:
                await self.refresh(name)
            except ModelLoadError:
                pass  # already logged; /readyz reports it

    async def refresh(self, name: str, force: bool = False) -> RefreshResult:
        """Re-resolve ``name``'s source; load and swap in the new version if it changed."""
        slot = self._slots[name]
        async with slot.lock:  # one refresh per model at a time
            current = self._loaded.get(name)
            previous = current.version if current else None
            try:
                resolved = await asyncio.to_thread(self._resolve, slot.source)
                if not force and current is not None and (
                    current.resolved.fingerprint == resolved.fingerprint
                ):
                    return RefreshResult(name, False, previous, current)
                new = await asyncio.to_thread(self._load, name, slot.source, resolved)
            except Exception as e:  # registry down, alias missing, corrupt bundle...
                log.warning("loading %s from %s failed: %s: %s", name, slot.source,
                            type(e).__name__, e)
                slot.error = public_message(f"{type(e).__name__}: {e}")
                if self.metrics:
                    self.metrics.model_loads.labels(name, "error").inc()
                level = logging.WARNING if current is None else logging.ERROR
                log.log(level, "cannot load model %r from %s: %s%s", name, slot.source,
                        slot.error, "" if current is None else
                        f" (still serving version {current.version})")
                raise ModelLoadError(slot.error) from e
            self._loaded[name] = new  # the swap: atomic for readers
            slot.error = None
            if self.on_swap is not None:
                try:
                    self.on_swap(name, resolved.fingerprint)
                except OSError as e:  # the others catch up at their next poll
                    log.warning("could not publish %r version %s: %s", name, new.version, e)
            if self.metrics:
                self.metrics.model_loads.labels(name, "ok").inc()
                self.metrics.model_load_seconds.labels(name).set(new.load_seconds)
                self.metrics.model_loaded.labels(name).set(1)
            if current is None:
                log.info("serving %r version %s from %s (loaded in %.2fs)", name, new.version,
                         slot.source, new.load_seconds)
            else:
                log.info("swapped %r: version %s -> %s (loaded in %.2fs)", name, previous,
                         new.version, new.load_seconds)
            return RefreshResult(name, True, previous, new)

    async def poll_forever(self, interval_s: float) -> None:
        """Refresh every model every ``interval_s`` seconds (the background task)."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.discover)
            for name in list(self._slots):
                try:
                    await self.refresh(name)
                except ModelLoadError:
                    pass
                except Exception:  # never let the poller die
                    log.exception("model poll failed for %r", name)

    # --- blocking helpers (run in worker threads) -----------------------------------------------

    def _resolve(self, source: str) -> Resolved:
        if source.startswith("models:/"):
            ref = tracking.resolve_model(source, client=self.client)
            return Resolved(
                fingerprint=f"{ref.name}/{ref.version}", version=ref.version, alias=ref.alias,
                run_id=ref.run_id, artifact_uri=f"models:/{ref.name}/{ref.version}",
            )
        if source.startswith("runs:/"):
            run_id = source.removeprefix("runs:/").split("/", 1)[0]
            return Resolved(fingerprint=source, run_id=run_id, artifact_uri=source)
        path = Path(source.removeprefix("file://")).expanduser()
        bundle_dir = path if (path / META).is_file() else tracking.bundle_dir_in_model(path)
        if bundle_dir is None:
            raise FileNotFoundError(f"{path} is neither a model bundle nor an MLflow model")
        st = (bundle_dir / WEIGHTS).stat()
        return Resolved(fingerprint=f"{bundle_dir}:{st.st_mtime_ns}:{st.st_size}",
                        local_path=bundle_dir)

    def _load(self, name: str, source: str, resolved: Resolved) -> LoadedModel:
        start = time.perf_counter()
        tmp: str | None = None
        try:
            if resolved.local_path is not None:
                bundle = load_bundle(resolved.local_path)
            else:
                assert resolved.artifact_uri is not None
                tmp = tempfile.mkdtemp(prefix=f"vit-service-{name}-")
                bundle = load_bundle(tracking.download_bundle_uri(resolved.artifact_uri, tmp))
        finally:
            if tmp is not None:  # weights and tokenizer are in memory now
                shutil.rmtree(tmp, ignore_errors=True)
        # at rest on the fused path (fp32's); a bf16 execution switches it for its blocks
        set_fused_attn(bundle.model, True)
        for p in bundle.model.parameters():
            p.requires_grad_(False)
        execution = resolve_execution("serve", precision=self.settings.inference_precision)
        forwards = (trace_forwards(bundle.model, bundle.meta.task, bundle.meta.preprocess, name,
                                   execution)
                    if self.settings.trace_forwards else eager_forwards(bundle.model, execution))
        loaded = LoadedModel(
            name=name, source=source, bundle=bundle, resolved=resolved,
            run_url=self._run_url(resolved.run_id),
            loaded_at=datetime.now(UTC), load_seconds=time.perf_counter() - start,
            forwards=forwards,
        )
        reason = probe_relevance(loaded)
        if reason is not None:
            log.warning("model %s cannot give relevance in %s: %s", name, loaded.precision,
                        reason)
            loaded.mark_relevance_unavailable(reason)
        return loaded

    def _run_url(self, run_id: str | None) -> str | None:
        base = self.settings.mlflow_ui_url
        if base is None and self.tracking_uri.startswith(("http://", "https://")):
            base = strip_credentials(self.tracking_uri)  # a link for anyone: no user:pass@
        if base is None or run_id is None:
            return None
        try:
            exp = self.client.get_run(run_id).info.experiment_id
        except Exception as e:  # a link is not worth failing a load for
            log.debug("no experiment for run %s: %s", run_id, e)
            return None
        return f"{base.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"


def probe_relevance(model: LoadedModel) -> str | None:
    """Run the relevance pass once on a blank input, as a request would (served precision,
    the model's grid and query row, inference mode): None if it works, else why not, in a
    sentence for the model card and the 422 a request for relevance then gets."""
    from vit_service.pipeline import ExplainSpec, ImageInputs, Inputs, TextInputs, explain_batch

    net, meta, precision = model.bundle.model, model.bundle.meta, model.precision
    if not hasattr(net, "attention_graph"):
        return "the model has no attention graph to differentiate"
    try:
        if meta.task == "image":
            size = int(meta.preprocess["image_size"])
            inputs: Inputs = ImageInputs(torch.zeros(1, 3, size, size))
        else:
            inputs = TextInputs(torch.zeros(1, 4, dtype=torch.long),
                                torch.ones(1, 4, dtype=torch.bool))
        res = explain_batch(net, inputs, ExplainSpec(relevance=True), model.forwards)
        assert res.relevance is not None
        if not bool(torch.isfinite(res.relevance).all()):
            return "the relevance pass gives non-finite values"
    except Exception as e:  # noqa: BLE001 (any failure means: no relevance for this model)
        log.debug("relevance probe failed", exc_info=True)
        return f"the relevance pass fails in {precision} ({type(e).__name__})"
    return None
