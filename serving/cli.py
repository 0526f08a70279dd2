"""``vit-service serve``: the REST API under uvicorn (:mod:`serving.server`).

``vit-service up``: an MLflow tracking server and the API together (see :mod:`serving.up`).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from vit_service.config import Settings

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


def serve(args: argparse.Namespace) -> int:
    from serving.server import run_api

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
