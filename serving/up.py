"""``vit-service up``: an MLflow tracking server and the API server, wired to each other.

The MLflow server keeps runs and the model registry in SQLite (or ``--backend-store-uri``) and
proxies artifacts to a local folder; the API server (and every training job it launches) talks to
it over HTTP. Ctrl-C (or SIGTERM) stops both.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vit_service.config import Settings

log = logging.getLogger(__name__)


def start_mlflow_server(
    settings: Settings, host: str, port: int, backend_uri: str | None = None,
    log_path: Path | None = None,
) -> subprocess.Popen:
    """Start ``mlflow server`` in its own process and return once its /health answers."""
    home = settings.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    backend = backend_uri or f"sqlite:///{home / 'mlflow.db'}"
    artifacts = home / "mlartifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
        "--artifacts-destination", str(artifacts), "--serve-artifacts",
        "--host", host, "--port", str(port), "--workers", "1",
    ]
    out = open(log_path or home / "mlflow-server.log", "ab")  # noqa: SIM115 (child owns it)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://{_client_host(host)}:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}; see {out.name}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    log.info("MLflow tracking server and UI at %s (backend %s)", url, backend)
                    return proc
        except OSError:
            time.sleep(0.5)
    stop_process(proc)
    raise RuntimeError(f"mlflow server did not answer on {url} within 120 s; see {out.name}")


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def run_up(args: argparse.Namespace, base: Settings) -> int:
    from serving.server import run_api

    host = _client_host(base.host)
    # MLflow has no authentication of its own here and the API serves whatever @champion
    # points to: it listens on loopback whatever host the API takes, unless told otherwise
    mlflow_host = args.mlflow_host
    mlflow_url = f"http://{_client_host(mlflow_host)}:{args.mlflow_port}"
    if mlflow_host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("MLflow listens on %s: anyone who reaches it can register a model that "
                    "this API then serves", mlflow_host)
    proc = start_mlflow_server(base, mlflow_host, args.mlflow_port, args.backend_store_uri)
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_url  # for anything that reads the environment
    settings = base.model_copy(update={
        "tracking_uri": mlflow_url,
        "mlflow_ui_url": base.mlflow_ui_url or mlflow_url,
    })
    if not settings.principals:
        log.warning("VIT_SERVICE_API_KEY is not set (nor VIT_SERVICE_API_KEYS): job and "
                    "model-management routes are refused until it is")
    print(f"MLflow UI:  {mlflow_url}\nAPI and web page: http://{host}:{settings.port}/  "
          f"(API docs at /docs)", flush=True)
    try:
        run_api(settings, args.log_level)
    finally:
        stop_process(proc)
        log.info("MLflow server stopped")
    return 0
