"""What the serving benchmarks share: a free port, a model registered in a fresh MLflow home,
a server process run to readiness and stopped, and a test image
(:mod:`bench_serving`, :mod:`soak`)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register(home: Path, bundle: Path | None, preset: str, name: str) -> tuple[str, Path]:
    """Register ``bundle`` (or a fresh ``preset`` image model) as ``name@champion`` in a
    temporary MLflow; returns (models:/ URI, bundle folder)."""
    import mlflow

    from vit_service import tracking
    from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD, BundleMeta, load_bundle, save_bundle
    from vit_service.config import Settings
    from vit_service.models import config_to_dict, create_model

    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    tracking.configure(settings=settings)
    exp = tracking.ensure_experiment("bench-serving", settings=settings)
    if bundle is None:
        model = create_model(preset).eval()
        c = model.config
        meta = BundleMeta(
            task="image", model_config=config_to_dict(c),
            class_names=[f"class_{i}" for i in range(c.num_classes)],
            preprocess={"image_size": c.img_size, "mean": list(CIFAR10_MEAN),
                        "std": list(CIFAR10_STD)},
            extra={"note": "untrained, for benchmarking"})
        bundle = save_bundle(home / f"bundle-{name}", model, meta)
    task = load_bundle(bundle).meta.task
    with mlflow.start_run(experiment_id=exp, run_name=f"bench-{name}"):
        version = tracking.log_bundle(bundle, task, name)
    mlflow.MlflowClient().set_registered_model_alias(name, tracking.CHAMPION, version)
    return f"models:/{name}@champion", bundle


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, ready: str,
                 log: Path, workers: int = 1) -> None:
        self.name, self.url, self.ready, self.log = name, f"http://127.0.0.1:{port}", ready, log
        self.workers = workers  # processes that must answer ready (ours only)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, cwd=log.parent, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 240) -> float:
        """Until ``self.workers`` different processes have answered ready (ours name the ``pid``;
        each request is a new connection, which the kernel may give to any worker)."""
        start, ready = time.monotonic(), set()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                r = httpx.get(self.url + self.ready, timeout=2)
                if r.status_code == 200:
                    ready.add(r.json().get("pid", 0) if self.workers > 1 else 0)
                    if len(ready) >= self.workers:
                        return time.monotonic() - start
                    continue
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log.read_text()}")

    def rss_mb(self) -> float:
        """Resident memory of the server and its worker processes."""
        import psutil

        try:
            p = psutil.Process(self.proc.pid)
            return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20
        except psutil.Error:
            return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # its own session: the workers too
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def jpeg_image(size: int, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
