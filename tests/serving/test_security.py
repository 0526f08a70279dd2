"""Safe to put on a network: bounded decoding, allowed formats, keys, headers, short errors,
and a docker stack that publishes no unauthenticated control plane."""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from serving.errors import public_message, strip_credentials
from tests.serving.procs import REPO, Server
from vit_service.config import MIN_API_KEY_LENGTH, Settings

IMAGE = "/v1/predict/image"


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _one_bit(w: int, h: int) -> bytes:
    """A 1-bit PNG: a few kB that decode to w*h pixels (w*h*3 bytes once RGB)."""
    img = Image.new("1", (w, h), 0)
    img.paste(1, (0, 0, w // 2, h // 3))
    return _png(img)


def _multipart(images: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("file", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]


def _peak_rss_mb(pid: int) -> float:
    """The process's high-water mark of resident memory (VmHWM), in MB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def server(registry, tmp_path_factory) -> Server:
    home = tmp_path_factory.mktemp("security")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "MLFLOW_", "PROMETHEUS_"))}
    env.update({"VIT_SERVICE_HOME": str(home), "MLFLOW_TRACKING_URI": registry.uri,
                "VIT_SERVICE_MODELS": json.dumps({"cifar10-vit": str(registry.local_bundle)}),
                "VIT_SERVICE_API_KEY": "", "LOG_LEVEL": "WARNING"})
    s = Server(env, home, args=("--workers", "1"))
    s.start()
    deadline = time.monotonic() + 60
    while httpx.get(s.url + "/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "model not loaded"
        time.sleep(0.3)
    # warm up: the first request pays one-off allocations that are not the decoder's
    r = httpx.post(s.url + IMAGE, files=_multipart([_png(Image.new("RGB", (32, 32)))]))
    assert r.status_code == 200, r.text
    yield s
    s.stop()


def test_many_small_bombs_are_refused_from_their_headers(server: Server) -> None:
    """8 one-bit 3000x3000 PNGs (~4 kB each, 72 MP together): over the per-request pixel
    budget, refused before any is decoded; the server's memory does not move."""
    assert server.proc is not None
    before = _peak_rss_mb(server.proc.pid)
    bombs = [_one_bit(3000, 3000)] * 8
    assert sum(map(len, bombs)) < 200_000
    r = httpx.post(server.url + IMAGE, files=_multipart(bombs), timeout=60)
    assert r.status_code == 413, r.text
    assert "per request" in r.json()["detail"]
    assert _peak_rss_mb(server.proc.pid) - before < 30


def test_large_images_within_budget_decode_small(server: Server) -> None:
    """5 one-bit 3000x3000 PNGs (45 MP, within the budget) answer 200 with their own sizes,
    decoded towards the model's 32 px in their own mode: the memory rise stays far below the
    5 x 27 MB they would take as full-size RGB."""
    assert server.proc is not None
    before = _peak_rss_mb(server.proc.pid)
    r = httpx.post(server.url + IMAGE, files=_multipart([_one_bit(3000, 3000)] * 5),
                   timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [(x["width"], x["height"]) for x in results] == [(3000, 3000)] * 5
    assert _peak_rss_mb(server.proc.pid) - before < 60


def test_an_image_over_the_per_image_limit_is_413(server: Server) -> None:
    r = httpx.post(server.url + IMAGE, content=_one_bit(4096, 4096),
                   headers={"content-type": "image/png"}, timeout=60)
    assert r.status_code == 413 and "limit" in r.json()["detail"]


@pytest.mark.parametrize("fmt", ["PPM", "PCX", "TGA"])
def test_only_common_formats_are_decoded(server: Server, fmt: str) -> None:
    """Pillow opens these (and EPS, through Ghostscript where installed); the server does not."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(buf, format=fmt)
    r = httpx.post(server.url + IMAGE, files=_multipart([buf.getvalue()]), timeout=30)
    assert r.status_code == 400, r.text
    assert "PNG/JPEG/WEBP/BMP/GIF/TIFF" in r.json()["detail"]


def test_pages_carry_a_content_security_policy_and_docs_use_no_cdn(server: Server) -> None:
    for path in ("/", "/docs", "/healthz"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    docs = httpx.get(server.url + "/docs", timeout=10).text
    assert "cdn.jsdelivr" not in docs and "/docs-assets/swagger-ui-bundle.js" in docs
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert httpx.get(f"{server.url}/docs-assets/{asset}", timeout=10).status_code == 200
    assert "sessionStorage" in httpx.get(server.url + "/ui/app.js", timeout=10).text


def test_an_empty_key_counts_as_unset_and_a_short_one_is_refused(server: Server) -> None:
    # the module's server runs with VIT_SERVICE_API_KEY="" (compose's ${...:-}): routes that
    # need a key are refused, not opened to an empty bearer token
    r = httpx.post(server.url + "/v1/models/cifar10-vit/reload", timeout=10)
    assert r.status_code == 403 and "no API key is configured" in r.json()["detail"], r.text
    assert httpx.get(server.url + "/v1/info", timeout=10).json()["api_key_configured"] is False
    assert Settings(api_key="   ").api_key is None
    with pytest.raises(ValueError, match=f"at least {MIN_API_KEY_LENGTH}"):
        Settings(api_key="short")
    assert Settings(api_key="x" * MIN_API_KEY_LENGTH).api_key is not None


def test_error_messages_carry_no_credentials_or_paths() -> None:
    assert strip_credentials("https://bob:s3cret@mlflow.example:5000/x") == \
        "https://mlflow.example:5000/x"
    msg = public_message("MlflowException: cannot reach postgresql://vit:pw@db:5432/mlflow "
                         "(bundle /var/lib/vit-service/runs/x/bundle)")
    assert "pw" not in msg and "/var/lib" not in msg and "db:5432/mlflow" in msg


def test_compose_publishes_no_unauthenticated_control_plane() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    published = {name: [str(p) for p in svc.get("ports", [])]
                 for name, svc in compose["services"].items()}
    assert not published.get("ray-head"), published  # Ray's Job API runs any command
    for port in published["mlflow"]:  # no auth: loopback only by default
        assert port.startswith("${MLFLOW_BIND:-127.0.0.1}:"), port
    for name, ports in published.items():
        if name != "api":
            assert all("${" in p and "127.0.0.1" in p for p in ports), (name, ports)
