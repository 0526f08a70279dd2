"""``vit-service serve``: the REST API under uvicorn.

``vit-service up``: an MLflow tracking server and the API together (see :mod:`serving.up`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit_service.config import Settings

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by the commands that start the API; unset ones keep Settings' values."""
    p.add_argument("--host", default=None, help="bind address (default: VIT_SERVICE_HOST or "
                   "127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: VIT_SERVICE_PORT or "
                   "8000)")
    p.add_argument("--reload-interval", type=float, default=None, metavar="SECONDS",
                   help="poll the registry for moved aliases every SECONDS (0: never)")
    p.add_argument("--model", action="append", default=None, metavar="NAME=SOURCE",
                   help="serve SOURCE (models:/name@alias, models:/name/N, runs:/id/model or a "
                   "bundle folder) as NAME; repeatable; replaces VIT_SERVICE_MODELS")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="API processes (default: VIT_SERVICE_WORKERS, else one per core, at most "
                   "4); each serves every model with cores/N torch threads")
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-wait-ms", type=float, default=None)
    p.add_argument("--adaptive-wait", action=argparse.BooleanOptionalAction, default=None,
                   help="wait --max-wait-ms only while requests arrive at least that often "
                   "(default: on; VIT_SERVICE_ADAPTIVE_WAIT)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for arg, key in (("host", "host"), ("port", "port"), ("reload_interval", "reload_interval_s"),
                     ("max_batch_size", "max_batch_size"), ("max_wait_ms", "max_wait_ms"),
                     ("adaptive_wait", "adaptive_wait"), ("workers", "workers")):
        value = getattr(args, arg, None)
        if value is not None:
            overrides[key] = value
    settings = Settings(**overrides)
    if args.model:
        models = {}
        for spec in args.model:
            name, sep, source = spec.partition("=")
            if not sep or not name or not source:
                raise SystemExit(f"--model expects NAME=SOURCE, got {spec!r}")
            models[name] = source
        # set after construction: a dict passed to Settings() would be merged with the env's
        settings = settings.model_copy(update={"models": models})
    return settings


def default_workers() -> int:
    """One process per core (one torch thread each), at most 4: on 2 cores, 2 workers gave
    1.25x the throughput of one at c = 32 (docs/serving.md, "Benchmark"), at ~0.8 GB each."""
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


def serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    log.info("serving %s on http://%s:%d", json.dumps(settings.models), settings.host,
             settings.port)
    run_api(settings, args.log_level)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the REST API (uvicorn)",
                              description="Serve the configured models over HTTP.")
    add_server_arguments(p)
    p.set_defaults(func=serve)

    up = subparsers.add_parser(
        "up", help="start an MLflow tracking server and the API, wired together",
        description="MLflow server (SQLite backend, local artifacts, UI) + the API; Ctrl-C stops "
        "both.")
    add_server_arguments(up)
    up.add_argument("--mlflow-port", type=int, default=5000, help="MLflow server and UI port")
    up.add_argument("--mlflow-host", default="127.0.0.1",
                    help="MLflow's bind address (default: loopback whatever --host is: MLflow "
                    "has no authentication here, and what it registers gets served)")
    up.add_argument("--backend-store-uri", default=None,
                    help="MLflow backend (default: SQLite under VIT_SERVICE_HOME)")
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from serving.up import run_up

    return run_up(args, settings_from_args(args))
