"""The FastAPI application: ``create_app(settings)`` (also the uvicorn factory).

Start-up (lifespan): point MLflow at the settings' tracking URI; if this process leads
(:mod:`serving.workers`: one per home however many workers, or one per PostgreSQL jobs database
however many hosts), start the job scheduler and the background poll that picks up moved
aliases, and stop both if the leadership is lost; try to load every configured model (a
missing one is logged, /readyz answers 503 and predictions for it 503 until it appears); follow
the versions the other processes publish. Shut-down stops the tasks and the batchers.
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
from serving.workers import (
    Leadership,
    ModelSync,
    PgLeadership,
    exit_with_parent,
    leadership_for,
)
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
    app.state.leadership = leadership_for(settings)
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
    if not settings.principals:
        log.warning("no API key configured (VIT_SERVICE_API_KEY / VIT_SERVICE_API_KEYS): "
                    "every mutating endpoint is refused with 403")
    log.info("tracking URI %s; models: %s", uri, settings.models)
    tasks: list[asyncio.Task] = []
    poll: list[asyncio.Task] = []  # the registry poll, while this process leads
    leading = False  # the job scheduler runs in this process
    # The registry poll runs once per home: with the job scheduler under the home's flock, but
    # apart from it when jobs lead per PostgreSQL database (every host must still refresh its
    # own models: no other host's poll reaches them)
    several = sync is not None
    home_lead = (Leadership(settings.home / "serving.lock" if several else None)
                 if isinstance(leadership, PgLeadership) else leadership)
    poll_with_jobs = home_lead is leadership

    async def lead() -> None:
        """The job scheduler runs in one process: per home, or per PostgreSQL jobs database
        (serving/workers.py); the registry poll with it per home (else: ``home_lead``)."""
        nonlocal leading
        leading = True
        await asyncio.to_thread(job_manager.start)  # re-adopts or settles jobs left running
        if settings.reload_interval_s > 0 and poll_with_jobs:
            poll.append(asyncio.create_task(
                store.poll_forever(settings.reload_interval_s), name="model-poll"))

    async def step_down() -> None:
        """The hold was lost (another process may lead already): stop what only the leader
        runs (launching, settling other hosts' jobs, the registry poll), so that two schedulers
        never run on for long. The jobs this process started go on: it follows them to their
        end and renews their leases (a lost lock must not fail healthy jobs), and re-adopts
        them if it leads again; were it to die, the leader settles them once their lease has
        expired."""
        nonlocal leading
        for task in poll:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        poll.clear()
        if leading:
            leading = False
            await asyncio.to_thread(job_manager.step_down)
        await asyncio.to_thread(leadership.release)

    async def keep_leading() -> None:
        """While leading, check the hold every ``leader_check_s`` and step down when it is
        lost; while not, try to take it as often (its holder may die, however it dies)."""
        while True:
            if leadership.is_leader:
                while await asyncio.to_thread(leadership.check):
                    await asyncio.sleep(settings.leader_check_s)
                await step_down()
                log.warning("process %d no longer leads %s: it launches no job and polls no "
                            "registry (the jobs it started are followed to their end)",
                            os.getpid(), leadership.where)
            while not await asyncio.to_thread(leadership.try_acquire):
                await asyncio.sleep(settings.leader_check_s)
            try:
                await lead()
            except Exception:  # e.g. the database went away again: retry from the start
                log.exception("process %d could not start leading", os.getpid())
                await step_down()
                await asyncio.sleep(settings.leader_check_s)

    if await asyncio.to_thread(leadership.try_acquire):
        await lead()
    else:
        log.info("another process leads %s: this one serves only", leadership.where)
    if not leadership.is_leader or isinstance(leadership, PgLeadership):  # a hold to watch
        tasks.append(asyncio.create_task(keep_leading(), name="leadership"))
    if not poll_with_jobs and settings.reload_interval_s > 0:

        async def poll_for_this_home() -> None:
            while not await asyncio.to_thread(home_lead.try_acquire):
                await asyncio.sleep(settings.leader_check_s)
            await store.poll_forever(settings.reload_interval_s)

        tasks.append(asyncio.create_task(poll_for_this_home(), name="model-poll"))
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
        for task in poll:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await st.service.close()
        # (also after a step-down: the thread may still follow this host's attempts)
        await asyncio.to_thread(job_manager.stop)  # running jobs go on; re-adopted
        leadership.release()
        if not poll_with_jobs:
            home_lead.release()
