"""Latency and throughput of our API versus ``mlflow models serve``, same model, same machine.

A model is registered in a temporary MLflow (SQLite) — by default a freshly initialised
``vit_nano_patch4_32`` bundle (6x128, 8x8 patch grid) — or ``--model-uri`` points at an existing
registered one (with ``MLFLOW_TRACKING_URI`` / ``--tracking-uri``). Both servers are started as
real processes on localhost, side by side:

* ours: ``vit-service serve`` (uvicorn, micro-batching), raw ``image/png`` bodies, ``top_k=1``,
  once with ``attention=none`` and once with ``attention=rollout``;
* MLflow's: ``mlflow models serve -m models:/... --env-manager local`` (the pyfunc wrapper
  ``vit_service.tracking.BundlePyfunc``), JSON ``dataframe_split`` with a base64 ``image``.

For each concurrency level (1, 8, 32 by default) a fixed number of single-image requests is sent
by an asyncio ``httpx`` client (``c`` requests in flight), after a warm-up; reported: p50/p95/p99
latency and requests/s. The load generator shares the CPU with the servers, so absolute
numbers are for this machine only; the servers are measured one at a time.

    python benchmarks/bench_serving.py                         # ~3 minutes on 2 cores
    python benchmarks/bench_serving.py --requests 100 --concurrency 1 8 --out bench.json
    python benchmarks/bench_serving.py --model-uri models:/cifar10-vit@champion
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register_fresh_model(home: Path, preset: str) -> str:
    """A freshly initialised bundle registered as ``bench-vit@champion``; returns the URI."""
    import mlflow

    from vit_service import tracking
    from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD, BundleMeta, save_bundle
    from vit_service.config import Settings
    from vit_service.models import config_to_dict, create_model

    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    tracking.configure(settings=settings)
    exp = tracking.ensure_experiment("bench-serving", settings=settings)
    model = create_model(preset).eval()
    c = model.config
    meta = BundleMeta(
        task="image", model_config=config_to_dict(c),
        class_names=[f"class_{i}" for i in range(c.num_classes)],
        preprocess={"image_size": c.img_size, "mean": list(CIFAR10_MEAN),
                    "std": list(CIFAR10_STD)},
        extra={"note": "untrained, for benchmarking"},
    )
    bundle = save_bundle(home / "bundle", model, meta)
    with mlflow.start_run(experiment_id=exp, run_name=f"bench-{preset}"):
        version = tracking.log_bundle(bundle, "image", "bench-vit")
    mlflow.MlflowClient().set_registered_model_alias("bench-vit", tracking.CHAMPION, version)
    return "models:/bench-vit@champion"


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], url: str, ready: str,
                 log: Path) -> None:
        self.name, self.url, self.ready, self.log = name, url, ready, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, cwd=log.parent, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # its own session: uvicorn workers too
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


async def load(url: str, make_request: dict[str, Any], n: int, concurrency: int,
               warmup: int) -> tuple[list[float], float, int]:
    """``n`` identical requests, ``concurrency`` in flight: (latencies s, wall s, errors)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        for _ in range(warmup):
            r = await client.post(**make_request)
            r.raise_for_status()
        latencies: list[float] = []
        errors = 0
        remaining = n

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                r = await client.post(**make_request)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return latencies, wall, errors


def summarise(latencies: list[float], wall: float, errors: int, c: int) -> dict[str, Any]:
    ms = np.array(latencies) * 1000
    return {
        "requests": len(latencies), "errors": errors, "concurrency": c,
        "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
        "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
        "req_per_s": len(latencies) / wall, "wall_s": wall,
    }


def batch_counts(url: str) -> tuple[float, float]:
    """(batches, inputs) so far, from our server's Prometheus metrics."""
    batches = inputs = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vit_service_batch_size_count"):
            batches += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vit_service_batch_size_sum"):
            inputs += float(line.rsplit(" ", 1)[1])
    return batches, inputs


def png_image(size: int, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-uri", default=None, help="existing registered model (models:/...)")
    p.add_argument("--tracking-uri", default=None, help="with --model-uri (default: env)")
    p.add_argument("--preset", default="vit_nano_patch4_32", help="fresh model's preset")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: 150 at c=1, 300 at c=8, 600 at c>=32)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="alternate the targets this many times")
    p.add_argument("--image-size", type=int, default=32, help="side of the PNG sent")
    p.add_argument("--skip-mlflow", action="store_true", help="only measure our server")
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--max-wait-ms", type=float, default=None)
    p.add_argument("--out", type=Path, default=ROOT / ".vit-service" / "bench" /
                   "bench_serving.json")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIT_SERVICE_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # mlflow serve runs `uvicorn`
    env["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    if args.model_uri:
        uri = args.model_uri
        tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            p.error("--model-uri needs --tracking-uri or MLFLOW_TRACKING_URI")
    else:
        t0 = time.perf_counter()
        uri = register_fresh_model(tmp, args.preset)
        tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
        print(f"registered a fresh {args.preset} as {uri} in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env["VIT_SERVICE_HOME"] = str(tmp / "home")

    ours_port, mlflow_port = free_port(), free_port()
    serve_cmd = [str(BIN / "vit-service"), "serve", "--host", "127.0.0.1", "--port",
                 str(ours_port), "--reload-interval", "0", "--model", f"bench={uri}",
                 "--log-level", "warning"]
    if args.max_batch_size:
        serve_cmd += ["--max-batch-size", str(args.max_batch_size)]
    if args.max_wait_ms is not None:
        serve_cmd += ["--max-wait-ms", str(args.max_wait_ms)]
    servers = [Server("ours", serve_cmd, env, f"http://127.0.0.1:{ours_port}", "/readyz",
                      tmp / "ours.log")]
    if not args.skip_mlflow:
        servers.append(Server(
            "mlflow", [str(BIN / "mlflow"), "models", "serve", "-m", uri, "--env-manager",
                       "local", "--host", "127.0.0.1", "-p", str(mlflow_port)],
            env, f"http://127.0.0.1:{mlflow_port}", "/ping", tmp / "mlflow.log"))
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        for s in servers:
            print(f"{s.name} ready in {s.wait_ready():.1f}s", file=sys.stderr)
        img = png_image(args.image_size)
        b64 = base64.b64encode(img).decode()
        targets = [
            ("ours attention=none", servers[0], {
                "url": "/v1/predict/image", "content": img,
                "params": {"model": "bench", "attention": "none", "top_k": 1},
                "headers": {"content-type": "image/png"}}),
            ("ours attention=rollout", servers[0], {
                "url": "/v1/predict/image", "content": img,
                "params": {"model": "bench", "attention": "rollout", "top_k": 1},
                "headers": {"content-type": "image/png"}}),
        ]
        if not args.skip_mlflow:
            targets.append(("mlflow models serve", servers[1], {
                "url": "/invocations",
                "json": {"dataframe_split": {"columns": ["image"], "data": [[b64]]}}}))
        # sanity: each answers, and ours and mlflow's agree on the class
        answers = {}
        for name, server, req in targets:
            r = httpx.post(server.url + req["url"], **{k: v for k, v in req.items()
                                                       if k != "url"}, timeout=60)
            r.raise_for_status()
            body = r.json()
            answers[name] = (body["results"][0]["predictions"][0]["index"] if "results" in body
                             else body["predictions"][0]["index"])
        if len(set(answers.values())) != 1:
            print(f"warning: servers disagree on the class: {answers}", file=sys.stderr)
        for c in args.concurrency:
            before = batch_counts(servers[0].url)
            n = args.requests or (150 if c == 1 else 300 if c < 32 else 600)
            # rounds alternate the targets, so load from other processes hits them alike
            acc: dict[str, tuple[list[float], float, int]] = {t[0]: ([], 0.0, 0) for t in targets}
            for rnd in range(args.rounds):
                chunk = n // args.rounds + (1 if rnd < n % args.rounds else 0)
                for name, server, req in targets:
                    lat, wall, err = asyncio.run(load(server.url, req, chunk, c,
                                                      args.warmup if rnd == 0 else 2))
                    prev = acc[name]
                    acc[name] = (prev[0] + lat, prev[1] + wall, prev[2] + err)
            after = batch_counts(servers[0].url)
            n_batches, n_inputs = after[0] - before[0], after[1] - before[1]
            for name, _, _ in targets:
                res = summarise(*acc[name], c)
                res["target"] = name
                if name.startswith("ours"):  # both of our targets together, warm-up included
                    res["our_mean_batch_size"] = n_inputs / max(n_batches, 1)
                results.append(res)
                print(f"  {name:24s} c={c:<3d} p50={res['p50_ms']:7.1f}ms "
                      f"p95={res['p95_ms']:7.1f}ms p99={res['p99_ms']:7.1f}ms "
                      f"{res['req_per_s']:7.1f} req/s  errors={res['errors']}", file=sys.stderr)
        batch_stats = httpx.get(servers[0].url + "/metrics").text
    finally:
        for s in servers:
            s.stop()

    # --- report ---------------------------------------------------------------------------------
    header = (f"{'target':24s} {'c':>3s} {'p50 ms':>8s} {'p95 ms':>8s} {'p99 ms':>8s} "
              f"{'req/s':>8s} {'errors':>6s} {'batch':>6s}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r['target']:24s} {r['concurrency']:>3d} {r['p50_ms']:8.1f} "
                     f"{r['p95_ms']:8.1f} {r['p99_ms']:8.1f} {r['req_per_s']:8.1f} "
                     f"{r['errors']:>6d} "
                     + (f"{r['our_mean_batch_size']:6.1f}" if "our_mean_batch_size" in r
                        else f"{'-':>6s}"))
    overhead = []
    for c in args.concurrency:
        by = {r["target"]: r for r in results if r["concurrency"] == c}
        none, roll = by["ours attention=none"], by["ours attention=rollout"]
        row = {"concurrency": c,
               "p50_ms_extra": roll["p50_ms"] - none["p50_ms"],
               "p50_ratio": roll["p50_ms"] / none["p50_ms"],
               "throughput_ratio": roll["req_per_s"] / none["req_per_s"]}
        if "mlflow models serve" in by:
            m = by["mlflow models serve"]
            row["ours_vs_mlflow_throughput"] = none["req_per_s"] / m["req_per_s"]
            row["ours_vs_mlflow_p50"] = none["p50_ms"] / m["p50_ms"]
        overhead.append(row)
    lines.append("")
    lines.append("rollout vs none (ours): " + "; ".join(
        f"c={o['concurrency']}: p50 {o['p50_ms_extra']:+.1f} ms (x{o['p50_ratio']:.2f}), "
        f"throughput x{o['throughput_ratio']:.2f}" for o in overhead))
    if not args.skip_mlflow:
        lines.append("ours (none) vs mlflow: " + "; ".join(
            f"c={o['concurrency']}: throughput x{o['ours_vs_mlflow_throughput']:.2f}, "
            f"p50 x{o['ours_vs_mlflow_p50']:.2f}" for o in overhead))
    sizes = [ln for ln in batch_stats.splitlines()
             if ln.startswith(("vit_service_batch_size_sum", "vit_service_batch_size_count"))]
    lines.append("our batches: " + ", ".join(sizes))
    lines.append(f"load average (1 min) before/after: {load_before[0]:.2f} / "
                 f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("\n".join(lines))

    import torch

    report = {
        "model_uri": uri, "preset": None if args.model_uri else args.preset,
        "image_size": args.image_size, "rounds": args.rounds, "results": results,
        "rollout_overhead": overhead,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform(),
                    "loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0]},
        "batch_metrics": sizes, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "note": "client and servers share the machine's CPUs; servers measured one at a time",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
