"""A real `vit-service serve` process for end-to-end tests (jobs API, web page)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def jobs_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment of a jobs-API server under ``root``: ``root/data`` with a generated
    CIFAR-10 archive (30 images per class), an empty ``root/home`` with its MLflow SQLite
    database, this process's environment without any ``VIT_SERVICE_``/``MLFLOW_``/``RAY_``
    setting of its own, fast polling, and ``extra`` (setting name -> value) on top."""
    from tests.training.conftest import make_cifar_archive

    data, home = root / "data", root / "home"
    data.mkdir(parents=True)
    home.mkdir()
    make_cifar_archive(data / "cifar10-jpeg-train.tar.gz", per_class=30)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "MLFLOW_", "RAY_"))}
    env.update({
        "VIT_SERVICE_HOME": str(home), "VIT_SERVICE_DATA_DIR": str(data),
        "VIT_SERVICE_CACHE_DIR": str(root / "cache"), "VIT_SERVICE_API_KEY": KEY,
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "VIT_SERVICE_JOBS_POLL_S": "0.2",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "LOG_LEVEL": "WARNING",
        **extra,
    })
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, env: dict[str, str], home: Path,
                 args: tuple[str, ...] = ("--workers", "1")) -> None:
        self.env, self.home, self.args = env, home, args
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = open(self.home / f"server-{port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vit_service.cli", "serve", "--port", str(port),
             "--reload-interval", "0", *self.args],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.home / f"server-{port}.log").read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("server did not start")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=AUTH, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {**AUTH, **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=30, **kw)

    def delete(self, path: str, **kw) -> httpx.Response:
        return httpx.delete(self.url + path, headers=AUTH, timeout=30, **kw)
