"""A real ``vit-service serve`` process (uvicorn) on a free port, and the CLI's arguments."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vit_service.cli import build_parser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command() -> list[str]:
    script = Path(sys.executable).with_name("vit-service")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vit_service.cli"]


@pytest.fixture
def server(registry, tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIT_SERVICE_")}
    env.update({
        "MLFLOW_TRACKING_URI": registry.uri,
        "VIT_SERVICE_HOME": str(registry.home),
        "VIT_SERVICE_MODELS": json.dumps({"cifar10-vit": "models:/cifar10-vit@champion",
                                          "imdb-sentiment": "models:/imdb-sentiment@champion"}),
        "VIT_SERVICE_API_KEY": "k3y-for-the-process-test",
    })
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_command(), "serve", "--host", "127.0.0.1", "--port", str(port),
             "--reload-interval", "0", "--workers", "1"],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text()}")
            time.sleep(0.25)
        yield base, proc, log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_real_uvicorn_server(server, image_bytes) -> None:
    base, proc, log = server
    with httpx.Client(base_url=base, timeout=30) as http:
        health = http.get("/healthz").json()
        assert health["status"] == "ok" and health["leader"] is True  # one process: it leads
        assert http.get("/readyz").status_code == 200
        r = http.post("/v1/predict/image", params={"top_k": 2},
                      files=[("file", ("a.png", image_bytes(), "image/png")),
                             ("file", ("b.jpg", image_bytes((50, 50), "JPEG"), "image/jpeg"))])
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"]["version"] == "1" and len(body["results"]) == 2
        assert len(body["results"][0]["attention"]["rollout"]) == 4
        r = http.post("/v1/predict/text", json={"text": ["good", "bad"]})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        r = http.post("/v1/predict/image", content=b"\0" * (11 * 1024 * 1024),
                      headers={"content-type": "image/png"})
        assert r.status_code == 413
        r = http.post("/v1/models/cifar10-vit/reload",
                      headers={"Authorization": "Bearer k3y-for-the-process-test"})
        assert r.status_code == 200 and r.json()["reloaded"] is False
        assert "vit_service_http_requests_total" in http.get("/metrics").text
    proc.terminate()
    # uvicorn shuts down gracefully, then re-raises SIGTERM (exit -15) like an unhandled one
    assert proc.wait(timeout=15) in (0, -15)
    assert "Application shutdown complete" in log.read_text()


def test_serve_arguments(monkeypatch) -> None:
    from serving.cli import settings_from_args

    monkeypatch.setenv("VIT_SERVICE_MODELS", '{"from-env": "/x"}')
    args = build_parser().parse_args(
        ["serve", "--port", "9001", "--reload-interval", "5", "--max-wait-ms", "0",
         "--model", "a=models:/a@champion", "--model", "b=/bundles/b"])
    s = settings_from_args(args)
    assert (s.port, s.reload_interval_s, s.max_wait_ms) == (9001, 5.0, 0.0)
    assert s.adaptive_wait is True  # the default
    args = build_parser().parse_args(["serve", "--no-adaptive-wait"])
    assert settings_from_args(args).adaptive_wait is False
    assert s.models == {"a": "models:/a@champion", "b": "/bundles/b"}  # replaces the env's
    args = build_parser().parse_args(["serve"])
    assert settings_from_args(args).models == {"from-env": "/x"}
    with pytest.raises(SystemExit):
        settings_from_args(build_parser().parse_args(["serve", "--model", "nonsense"]))
