"""The FastAPI application: ``create_app(settings)`` (also the uvicorn factory).

Start-up (lifespan): point MLflow at the settings' tracking URI; if this process leads its home
(:mod:`serving.workers`: one per home, however many workers), start the job scheduler and the
background poll that picks up moved aliases; try to load every configured model (a missing one
is logged, /readyz answers 503 and predictions for it 503 until it appears); follow the
versions the other processes publish. Shut-down stops the tasks and the batchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from fastapi import FastAPI

from serving.errors import install_error_handlers
from serving.inference import InferenceService
from serving.jobs import create_job_manager
from serving.metrics import MetricsMiddleware, ServingMetrics
from serving.middleware import BodySizeLimitMiddleware
from serving.model_cards import ModelCards
from serving.model_store import ModelStore
from serving.routers import datasets, health, jobs, models, predict
from serving.routers.ui import SecurityHeadersMiddleware, mount_ui
from serving.workers import Leadership, ModelSync, exit_with_parent
from vit_service import __version__, tracking
from vit_service.config import Settings, get_settings
from vit_service.data.datasets import DatasetStore
from vit_service.data.upload_checks import DatasetLimits

log = logging.getLogger(__name__)

API_PREFIX = "/v1"

DESCRIPTION = """\
Classify images (Vision Transformer) and texts (Transformer encoder) with models from the
MLflow registry, and see what they attended to: attention rollout, per-layer and per-head
[CLS] maps from the same forward pass as the prediction. See docs/serving.md.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    metrics = ServingMetrics()
    store = ModelStore(settings, metrics)
    several = (settings.workers or 1) > 1  # one of `serve --workers N`'s processes
    app = FastAPI(
        title="vit-service",
        version=__version__,
        description=DESCRIPTION,
        lifespan=_lifespan,
        docs_url=None,  # served by serving/routers/ui.py from local assets
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.store = store
    app.state.cards = ModelCards(store)
    app.state.service = InferenceService(store, settings, metrics)
    app.state.jobs = create_job_manager(settings)
    app.state.leadership = Leadership(settings.home / "serving.lock" if several else None)
    app.state.sync = ModelSync(settings.home / "serving-models.json", store) if several else None
    if app.state.sync is not None:
        store.on_swap = app.state.sync.publish
    app.state.datasets = DatasetStore(
        Path(settings.home) / "datasets",
        DatasetLimits(max_image_pixels=settings.max_image_pixels))

    install_error_handlers(app)
    jobs.install_job_error_handler(app)
    app.include_router(health.router)
    app.include_router(predict.router, prefix=API_PREFIX)
    app.include_router(models.router, prefix=API_PREFIX)
    app.include_router(jobs.router, prefix=API_PREFIX)
    app.include_router(datasets.router, prefix=API_PREFIX)
    mount_ui(app)
    # Middleware: the last added is the outermost, so metrics also see 413s from the limiter.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       path_limits={f"{API_PREFIX}/datasets": settings.max_dataset_bytes})
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(SecurityHeadersMiddleware)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start-up and shut-down (see the module docstring), over what ``create_app`` put in
    ``app.state``."""
    st = app.state
    settings, store, job_manager, leadership, sync = (st.settings, st.store, st.jobs,
                                                      st.leadership, st.sync)
    uri = tracking.configure(settings=settings)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    if settings.api_key is None:
        log.warning("no API key configured (VIT_SERVICE_API_KEY): "
                    "POST /v1/models/{name}/reload is refused with 403")
    log.info("tracking URI %s; models: %s", uri, settings.models)
    tasks: list[asyncio.Task] = []

    async def lead() -> None:
        """The job scheduler and the registry poll run in one process per home."""
        await asyncio.to_thread(job_manager.start)  # re-adopts or settles jobs left running
        if settings.reload_interval_s > 0:
            tasks.append(asyncio.create_task(
                store.poll_forever(settings.reload_interval_s), name="model-poll"))

    async def lead_when_free() -> None:  # another process leads: take over if it dies
        while not leadership.try_acquire():
            await asyncio.sleep(2.0)
        await lead()

    if leadership.try_acquire():
        await lead()
    else:
        log.info("another process leads %s: this one serves only", leadership.path)
        tasks.append(asyncio.create_task(lead_when_free(), name="leadership"))
    await store.load_all()
    missing = [n for n in store.names if store.get(n) is None]
    if missing:
        log.warning("not loaded yet (503 until available): %s", ", ".join(missing))
    if sync is not None:
        tasks.append(asyncio.create_task(sync.follow_forever(0.5), name="model-sync"))
        tasks.append(asyncio.create_task(exit_with_parent(settings.supervisor_pid),
                                         name="parent-watch"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await st.service.close()
        if leadership.is_leader:
            await asyncio.to_thread(job_manager.stop)  # running jobs go on; re-adopted
        leadership.release()
