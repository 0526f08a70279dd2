"""Soak: twice the sustainable load for a minute, plain and relevance requests mixed.

The server must shed what it cannot serve (503 with Retry-After) instead of queueing without
bound: this measures what it serves, how much it sheds, the tail latency of what it serves,
that nothing else fails (no 500s) and that its memory comes back.

1. ``vit-service serve --workers W`` (a real server; a fresh ``vit_nano_convstem_32`` bundle
   or ``--bundle``), warmed up;
2. its capacity, each kind alone at saturation (``hey -c 16`` plain, ``-c 8`` relevance with
   faithfulness): ``Rp`` and ``Rr`` requests per second;
3. the soak: ``--seconds`` (60) of plain requests offered at ``2 x 0.8 Rp`` and relevance ones
   at ``2 x 0.2 Rr`` at once (twice one capacity unit), open-loop: two ``hey`` processes with
   enough rate-limited connections (rate x 2.5 s) that the offered rate holds while answers
   wait; the server's resident memory (all its processes) sampled every 0.5 s.

    python benchmarks/soak.py                      # ~2.5 min, prints a table and JSON
    python benchmarks/soak.py --bundle path/to/bundle --seconds 60 --workers 2
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BIN, Server, free_port, jpeg_image, register  # noqa: E402

OPEN_LOOP_S = 2.5  # how long a connection may wait for an answer before the offered rate drops


def hey_rows(url: str, body: Path, concurrency: int, seconds: float,
             qps_per_worker: float | None = None) -> list[tuple[int, float]]:
    """``hey`` against ``url``: one ``(status, seconds)`` per response."""
    exe = shutil.which("hey")
    if exe is None:
        raise SystemExit("hey not found: apt-get install hey (make setup does)")
    cmd = [exe, "-z", f"{seconds}s", "-c", str(concurrency), "-t", "60", "-m", "POST",
           "-T", "image/jpeg", "-D", str(body), "-o", "csv"]
    if qps_per_worker:
        cmd += ["-q", f"{qps_per_worker:.3f}"]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    return [(int(r["status-code"]), float(r["response-time"]))
            for r in csv.DictReader(io.StringIO(out))]


def summary(rows: list[tuple[int, float]], seconds: float) -> dict[str, Any]:
    ok = [t for s, t in rows if s == 200]
    shed = sum(1 for s, _ in rows if s == 503)
    return {"sent": len(rows), "served": len(ok), "served_per_s": round(len(ok) / seconds, 1),
            "shed_503": shed, "shed_share": round(shed / max(1, len(rows)), 3),
            "other_5xx": sum(1 for s, _ in rows if s >= 500 and s != 503),
            "other_errors": sum(1 for s, _ in rows if s != 200 and s < 500),
            "p50_ms": round(float(np.percentile(ok, 50)) * 1000, 1) if ok else None,
            "p99_ms": round(float(np.percentile(ok, 99)) * 1000, 1) if ok else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=None)
    p.add_argument("--preset", default="vit_nano_convstem_32")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--probe-seconds", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    a = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="vit-soak-"))
    source, _ = register(tmp, a.bundle, a.preset, "soak-vit")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIT_SERVICE_", "MLFLOW_"))}
    env.update({"VIT_SERVICE_HOME": str(tmp / "home"),
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
                "VIT_SERVICE_MODELS": json.dumps({"soak-vit": source}),
                "VIT_SERVICE_DEFAULT_IMAGE_MODEL": "soak-vit", "LOG_LEVEL": "WARNING"})
    server = Server("ours", [str(BIN / "vit-service"), "serve", "--port", str(port),
                             "--workers", str(a.workers), "--reload-interval", "0"],
                    env, port, "/readyz", tmp / "server.log", workers=a.workers)
    body = tmp / "img.jpg"
    body.write_bytes(jpeg_image(32))
    plain = f"{server.url}/v1/predict/image?top_k=1"
    explain = f"{server.url}/v1/predict/image?top_k=1&attention=relevance&faithfulness=true"
    try:
        server.wait_ready()
        hey_rows(plain, body, 8, 3)  # warm-up: traces, allocator, first explain passes
        hey_rows(explain, body, 4, 3)
        load0 = os.getloadavg()[0]
        rp = summary(hey_rows(plain, body, 16, a.probe_seconds), a.probe_seconds)
        rr = summary(hey_rows(explain, body, 8, a.probe_seconds), a.probe_seconds)
        cap_p, cap_r = rp["served_per_s"], rr["served_per_s"]
        time.sleep(2)
        rss_before = server.rss_mb()
        peak, stop = [rss_before], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak.append(server.rss_mb())
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # twice one capacity unit: 80 % of the plain capacity + 20 % of the relevance one,
        # offered open-loop: enough connections, each rate-limited, that every one can wait
        # OPEN_LOOP_S for its answer and the offered rate still holds whatever the server does
        results: dict[str, list[tuple[int, float]]] = {}

        def run(kind: str, url: str, rate: float) -> None:
            c = max(8, int(rate * OPEN_LOOP_S))
            results[kind] = hey_rows(url, body, c, a.seconds, rate / c)

        threads = [threading.Thread(target=run, args=("plain", plain, 2 * 0.8 * cap_p)),
                   threading.Thread(target=run, args=("relevance", explain, 2 * 0.2 * cap_r))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
        time.sleep(3)
        rss_after = server.rss_mb()
        out = {
            "workers": a.workers, "seconds": a.seconds, "load_avg_1m_before": round(load0, 2),
            "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "capacity": {"plain_per_s": cap_p, "relevance_per_s": cap_r},
            "offered_per_s": {"plain": round(2 * 0.8 * cap_p, 1),
                              "relevance": round(2 * 0.2 * cap_r, 1)},
            "plain": summary(results["plain"], a.seconds),
            "relevance": summary(results["relevance"], a.seconds),
            "rss_mb": {"before": round(rss_before), "peak": round(max(peak)),
                       "after": round(rss_after)},
        }
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"capacity alone: plain {cap_p} req/s, relevance+faithfulness {cap_r} req/s; offered "
          f"{out['offered_per_s']} for {a.seconds:.0f}s (load {out['load_avg_1m_before']})")
    print(f"{'kind':10} {'sent':>6} {'served/s':>9} {'503 %':>6} {'other 5xx':>9} "
          f"{'p50 ms':>7} {'p99 ms':>7}")
    for kind in ("plain", "relevance"):
        s = out[kind]
        print(f"{kind:10} {s['sent']:6d} {s['served_per_s']:9.1f} {100 * s['shed_share']:6.1f} "
              f"{s['other_5xx']:9d} {s['p50_ms']!s:>7} {s['p99_ms']!s:>7}")
    print(f"RSS MB before / peak / after: {out['rss_mb']}")
    print(json.dumps(out))
    if a.out is not None:
        a.out.write_text(json.dumps(out, indent=2))
    return 0 if out["plain"]["other_5xx"] == 0 and out["relevance"]["other_5xx"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
