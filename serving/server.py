"""Running the API: one uvicorn process, or uvicorn's multiprocess supervisor over N workers
(each a whole app built from the environment; :mod:`serving.workers` keeps one leader and one
model version per home). Used by ``vit-service serve`` and ``vit-service up``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from vit_service.config import Settings

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)


def default_workers() -> int:
    """One process per core (one torch thread each), at most 4: a worker per core outruns one
    worker with more threads, at a worker's memory each (docs/serving.md, "Benchmark")."""
    return max(1, min(4, os.cpu_count() or 1))


def run_api(settings: Settings, log_level: str) -> None:
    """uvicorn with ``settings.workers`` processes (:mod:`serving.workers` keeps one leader and
    one model version per home). The workers are fresh interpreters that build the app from the
    environment, so the settings given on the command line are exported to them first."""
    import uvicorn

    workers = settings.workers or default_workers()
    if workers == 1:
        from serving.app import create_app

        uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                    log_level=log_level)
        return
    env = {"VIT_SERVICE_WORKERS": str(workers), "VIT_SERVICE_HOME": str(settings.home),
           "VIT_SERVICE_SUPERVISOR_PID": str(os.getpid()),
           "VIT_SERVICE_MODELS": json.dumps(settings.models),
           "VIT_SERVICE_RELOAD_INTERVAL_S": str(settings.reload_interval_s),
           "VIT_SERVICE_MAX_BATCH_SIZE": str(settings.max_batch_size),
           "VIT_SERVICE_MAX_WAIT_MS": str(settings.max_wait_ms),
           "VIT_SERVICE_ADAPTIVE_WAIT": str(settings.adaptive_wait).lower(),
           "VIT_SERVICE_TORCH_THREADS": str(
               settings.torch_threads or max(1, (os.cpu_count() or 1) // workers))}
    if settings.tracking_uri:
        env["MLFLOW_TRACKING_URI"] = settings.tracking_uri
    if settings.mlflow_ui_url:
        env["VIT_SERVICE_MLFLOW_UI_URL"] = settings.mlflow_ui_url
    os.environ.update(env)
    from serving.workers import prepare_home

    prepare_home(settings)
    # Prometheus: every worker writes its samples under this folder; /metrics sums them
    prom = Path(tempfile.mkdtemp(prefix="vit-service-prometheus-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)
    log.info("%d workers, %s torch threads each", workers, env["VIT_SERVICE_TORCH_THREADS"])
    config = uvicorn.Config("serving.app:create_app", factory=True, host=settings.host,
                            port=settings.port, log_level=log_level, workers=workers)
    try:
        _run_workers(config)
    finally:
        shutil.rmtree(prom, ignore_errors=True)


def _run_workers(config: uvicorn.Config) -> None:
    """uvicorn's multiprocess supervisor (health checks, restarts, signals); on Linux over one
    ``SO_REUSEPORT`` socket per worker, so that connections are spread evenly
    (:class:`serving.sockets.ReusePortSocket`)."""
    import socket

    from uvicorn.supervisors import Multiprocess

    from serving.sockets import reuseport_socket, reuseport_supported

    if reuseport_supported():
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        try:
            sock: socket.socket = reuseport_socket(family, config.host, config.port)
        except OSError as e:
            raise SystemExit(f"cannot listen on {config.host}:{config.port}: {e}") from e
        log.info("Uvicorn running on http://%s:%d (one SO_REUSEPORT socket per worker)",
                 config.host, sock.getsockname()[1])
    else:
        sock = config.bind_socket()
    try:
        Multiprocess(config, sockets=[sock]).run()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
