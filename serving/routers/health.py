"""``GET /healthz`` (alive), ``GET /readyz`` (models loaded) and ``GET /metrics``."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

from serving.deps import MetricsDep, SettingsDep, StoreDep
from serving.schemas import HealthResponse, ReadyResponse

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthResponse, summary="Liveness")
async def healthz(request: Request) -> HealthResponse:
    return HealthResponse(pid=os.getpid(), leader=request.app.state.leadership.is_leader)


@router.get(
    "/readyz",
    response_model=ReadyResponse,
    summary="Readiness: 200 when the models are loaded, else 503",
    responses={503: {"model": ReadyResponse, "description": "models missing"}},
)
async def readyz(store: StoreDep, settings: SettingsDep) -> JSONResponse:
    loaded = {n: m.version for n, m in store.loaded().items()}
    missing = [n for n in store.names if n not in loaded]
    ok = bool(loaded) and (not missing or not settings.ready_requires_all)
    body = ReadyResponse(status="ready" if ok else "not ready", loaded=loaded, missing=missing,
                         pid=os.getpid())
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                     "description": "Prometheus text format"}},
)
async def metrics(m: MetricsDep) -> Response:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # --workers N: the sum over the workers
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
