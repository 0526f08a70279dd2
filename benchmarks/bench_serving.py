"""Throughput and tail latency of our API versus ``mlflow models serve``, same model, one run.

The load comes from ``hey`` (a compiled load generator: ``apt-get install hey``, which
``make setup`` does), so that the client is not what is measured. Every server is a real
process on localhost, all started first and then measured in alternation (``--rounds``), so
that whatever else the machine does hits them alike:

* ours: ``vit-service serve --workers W`` for each W of ``--workers`` (micro-batching), raw
  ``image/jpeg`` bodies (one 32x32 JPEG), ``top_k=1``, with ``attention=none`` and with
  ``attention=rollout``; with the largest W also rollout and heads as ``f16-base64``, heads as
  JSON and ``attention=heads&overlay=true`` (``--image-extras``);
* MLflow's: ``mlflow models serve --workers W`` for each W of ``--mlflow-workers`` (the pyfunc
  wrapper ``vit_service.tracking.BundlePyfunc``; JSON ``dataframe_split`` with a base64
  ``image``; no attention at all).

With ``--text-bundle`` the same is done for a text model with a 200-word review. Also measured
in the same run: the model's own batched forward (batch 32, no HTTP; the better of one process
with a thread per core and one single-thread process per core), the limit any server can
reach; the per-stage time of our server from its Prometheus histograms
(``vit_service_stage_seconds``); its resident memory before and after each level.

    python benchmarks/bench_serving.py                             # fresh vit_nano, ~6 min
    python benchmarks/bench_serving.py --bundle path/to/bundle     # a trained model
    python benchmarks/bench_serving.py --seconds 3 --concurrency 8 --workers 2 --mlflow-workers 1
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BIN, ROOT, Server, free_port, jpeg_image, register  # noqa: E402

REVIEW = " ".join(  # ~200 words, a review-like mix
    ("this film was a pleasant surprise the cast is strong the story moves along and the "
     "ending works even if the middle drags a little at times i would watch it again").split()
    * 7)[:1200]


def hey(url: str, body: Path, content_type: str, concurrency: int, seconds: float
        ) -> tuple[list[float], int, float]:
    """``hey -z`` against ``url``: (latencies in s of the 200s, non-200 count, wall s)."""
    exe = shutil.which("hey")
    if exe is None:
        raise SystemExit("hey not found: apt-get install hey (make setup does)")
    cmd = [exe, "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST", "-T", content_type,
           "-D", str(body), "-o", "csv", url]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - start
    lat, errors = [], 0
    for row in csv.DictReader(io.StringIO(out)):
        if row.get("status-code") == "200":
            lat.append(float(row["response-time"]))
        else:
            errors += 1
    return lat, errors, min(wall, seconds) if lat else wall


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """``{(stage): (sum s, count)}`` and the batch size sum/count, from our /metrics."""
    out: dict[str, tuple[float, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for kind in ("sum", "count"):
            if line.startswith(f"vit_service_stage_seconds_{kind}{{"):
                stage = line.split('stage="', 1)[1].split('"', 1)[0]
                key = stage
            elif line.startswith(f"vit_service_batch_size_{kind}{{"):
                key = "batch"
            else:
                continue
            s, c = out.get(key, (0.0, 0.0))
            v = float(line.rsplit(" ", 1)[1])
            out[key] = (s + v, c) if kind == "sum" else (s, c + v)
    return out


def forward_rate(bundle: Path, seconds: float, threads: int, start_at: float = 0.0) -> float:
    """One process: batch-32 forwards, attention off, ``threads`` torch threads, no HTTP
    (timed from the wall-clock ``start_at``, so that several processes overlap). The forward
    is the one the server runs: traced, in the precision it serves in (``auto``)."""
    import torch

    from serving.compiled import trace_forwards
    from vit_service.bundle import load_bundle
    from vit_service.precision import resolve_precision

    torch.set_num_threads(threads)
    b = load_bundle(bundle)
    m = b.model.eval()
    for prm in m.parameters():
        prm.requires_grad_(False)
    fwd = trace_forwards(m, b.meta.task, b.meta.preprocess, "bench",
                         resolve_precision("auto")).plain
    if b.meta.task == "image":
        size = int(b.meta.preprocess["image_size"])
        x = torch.randn(32, 3, size, size)
        call = lambda: fwd(x)  # noqa: E731
    else:
        enc = b.tokenizer.encode_batch([REVIEW] * 32, int(b.meta.preprocess["max_len"]),
                                       b.meta.preprocess.get("truncation", "head"))
        call = lambda: fwd(enc.input_ids, enc.attention_mask)  # noqa: E731
    with torch.inference_mode():
        call()
        time.sleep(max(0.0, start_at - time.time()))
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call()
            n += 32
    return n / (time.perf_counter() - start)


def forward_limit(bundle: Path, seconds: float = 4.0) -> dict[str, float]:
    """The model's own throughput, the most any server can answer: batch-32 forwards with
    attention off and no HTTP, both as one process with a thread per core and as one
    single-thread process per core at once (how ``--workers N`` runs it; usually faster:
    no OpenMP barriers). ``best`` is the larger."""
    cores = os.cpu_count() or 1
    one = forward_rate(bundle, seconds, cores)
    cmd = [sys.executable, __file__, "--forward-rate", str(bundle), str(seconds),
           str(time.time() + 15)]  # all loaded and warm by then
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(cores)]
    each = [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return {"one_process": one, "process_per_core": sum(each), "best": max(one, sum(each))}


def summarise(lat: list[float], errors: int, wall: float) -> dict[str, Any]:
    ms = np.array(lat) * 1000 if lat else np.array([np.nan])
    return {"requests": len(lat), "errors": errors, "req_per_s": len(lat) / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
            "over_1s": int((ms > 1000).sum())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--forward-rate"]:  # internal: one process of forward_limit()
        print(forward_rate(Path(argv[1]), float(argv[2]), 1, float(argv[3])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=None, help="image model bundle (default: a "
                   "fresh --preset)")
    p.add_argument("--preset", default="vit_nano_patch4_32")
    p.add_argument("--text-bundle", type=Path, default=None, help="also a text model")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="ours: --workers")
    p.add_argument("--mlflow-workers", type=int, nargs="*", default=[1, 2])
    p.add_argument("--seconds", type=float, default=5.0, help="per target, level and round")
    p.add_argument("--rounds", type=int, default=2, help="alternate the targets this often")
    p.add_argument("--image-extras", nargs="*",
                   default=["rollout&encoding=f16-base64", "heads", "heads&encoding=f16-base64",
                            "heads&overlay=true"],
                   metavar="ATTENTION", help="also these image query strings (after "
                   "attention=), on ours with the largest --workers only")
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                   help="afterwards, load ours (largest --workers, rollout, c=32) this long "
                   "and sample its resident memory every 10 s: does it settle or grow?")
    p.add_argument("--out", type=Path, default=ROOT / ".vit-service" / "bench" /
                   "bench_serving.json")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "PROMETHEUS_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # mlflow serve runs `uvicorn`
    env["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    uri, bundle = register(tmp, args.bundle, args.preset, "bench-vit")
    models = {"bench-vit": uri}
    text_uri = None
    if args.text_bundle is not None:
        text_uri, _ = register(tmp, args.text_bundle, args.preset, "bench-text")
        models["bench-text"] = text_uri
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"

    img = tmp / "image.jpg"
    img.write_bytes(jpeg_image(32))
    img_json = tmp / "image.json"
    img_json.write_text(json.dumps({"dataframe_split": {
        "columns": ["image"], "data": [[base64.b64encode(img.read_bytes()).decode()]]}}))
    text_bodies = {}
    for att in ("none", "rollout"):  # the text route takes its options in the JSON body
        text_bodies[att] = tmp / f"text-{att}.json"
        text_bodies[att].write_text(json.dumps({"text": REVIEW, "model": "bench-text",
                                                "top_k": 1, "attention": att}))
    text_mlflow = tmp / "text-mlflow.json"
    text_mlflow.write_text(json.dumps({"dataframe_split": {"columns": ["text"],
                                                           "data": [[REVIEW]]}}))

    servers: dict[str, Server] = {}
    for w in args.workers:
        port = free_port()
        cmd = [str(BIN / "vit-service"), "serve", "--host", "127.0.0.1", "--port", str(port),
               "--reload-interval", "0", "--workers", str(w), "--log-level", "warning"]
        for name, u in models.items():
            cmd += ["--model", f"{name}={u}"]
        e = {**env, "VIT_SERVICE_HOME": str(tmp / f"home-{w}")}
        servers[f"ours-{w}"] = Server(f"ours --workers {w}", cmd, e, port, "/readyz",
                                      tmp / f"ours-{w}.log", workers=w)
    for task_uri, task in ((uri, "image"), (text_uri, "text")):
        for w in args.mlflow_workers if task_uri else []:
            port = free_port()
            cmd = [str(BIN / "mlflow"), "models", "serve", "-m", task_uri, "--env-manager",
                   "local", "--host", "127.0.0.1", "-p", str(port), "--workers", str(w)]
            servers[f"mlflow-{task}-{w}"] = Server(f"mlflow {task} --workers {w}", cmd, env,
                                                   port, "/ping", tmp / f"mlflow-{task}-{w}.log")
    targets: list[tuple[str, str, str, Path, str]] = []  # (label, server, path, body, type)
    for task, ctype in (("image", "image/jpeg"), ("text", "application/json")):
        if task == "text" and text_uri is None:
            continue
        for w in args.workers:
            for att in ("none", "rollout"):
                if task == "image":
                    path, body = f"/v1/predict/image?model=bench-vit&top_k=1&attention={att}", img
                else:
                    path, body = "/v1/predict/text", text_bodies[att]
                targets.append((f"{task} ours w={w} attention={att}", f"ours-{w}", path, body,
                                ctype))
        for att in args.image_extras if task == "image" else []:
            w = max(args.workers)
            targets.append((f"image ours w={w} attention={att}", f"ours-{w}",
                            f"/v1/predict/image?model=bench-vit&top_k=1&attention={att}", img,
                            ctype))
        for w in args.mlflow_workers:
            targets.append((f"{task} mlflow serve w={w}", f"mlflow-{task}-{w}", "/invocations",
                            img_json if task == "image" else text_mlflow, "application/json"))
        # (mlflow serve gets the same image / review, in its dataframe_split JSON)

    results: list[dict[str, Any]] = []
    stages: dict[str, dict[str, float]] = {}
    load_before = os.getloadavg()
    try:
        for s in servers.values():
            print(f"{s.name} ready in {s.wait_ready():.1f}s", file=sys.stderr)
        for label, server, path, body, ctype in targets:  # warm-up, and every answer is a 200
            lat, err, _ = hey(servers[server].url + path, body, ctype, 2, 1.0)
            if err or not lat:
                raise SystemExit(f"{label}: {err} errors in the warm-up")
        limit_detail = {"image": forward_limit(bundle)}
        if args.text_bundle is not None:
            limit_detail["text"] = forward_limit(args.text_bundle)
        limits = {task: d["best"] for task, d in limit_detail.items()}
        print(f"model forward limits (batch 32, no HTTP): {limits}", file=sys.stderr)
        for c in args.concurrency:
            acc: dict[str, tuple[list[float], int, float]] = {t[0]: ([], 0, 0.0) for t in targets}
            rss_before = {k: s.rss_mb() for k, s in servers.items() if k.startswith("ours")}
            per_target_stages: dict[str, dict[str, float]] = {}
            for _ in range(args.rounds):
                for label, server, path, body, ctype in targets:
                    t0 = stage_totals(servers[server].url) if server.startswith("ours") else {}
                    lat, err, wall = hey(servers[server].url + path, body, ctype, c,
                                         args.seconds)
                    if server.startswith("ours"):
                        t1 = stage_totals(servers[server].url)
                        d = per_target_stages.setdefault(label, {})
                        for k, (s1, n1) in t1.items():
                            s0, n0 = t0.get(k, (0.0, 0.0))
                            d[k + "_s"] = d.get(k + "_s", 0.0) + s1 - s0
                            d[k + "_n"] = d.get(k + "_n", 0.0) + n1 - n0
                    prev = acc[label]
                    acc[label] = (prev[0] + lat, prev[1] + err, prev[2] + wall)
            for label, _server, *_ in targets:
                r = summarise(*acc[label])
                r.update(target=label, concurrency=c)
                task = label.split()[0]
                r["of_forward_limit"] = r["req_per_s"] / limits[task]
                if label in per_target_stages:
                    d = per_target_stages[label]
                    r["mean_batch"] = d.get("batch_s", 0) / max(d.get("batch_n", 0), 1)
                    stages[f"{label} c={c}"] = {
                        k[:-2]: 1000 * d[k] / max(d[k[:-2] + "_n"], 1)
                        for k in d if k.endswith("_s") and k != "batch_s"}
                results.append(r)
                print(f"  {label:36s} c={c:<3d} p50={r['p50_ms']:7.1f} p95={r['p95_ms']:7.1f} "
                      f"p99={r['p99_ms']:7.1f} max={r['max_ms']:7.1f} ms "
                      f"{r['req_per_s']:7.1f} req/s err={r['errors']}", file=sys.stderr)
            for k, mb in rss_before.items():
                print(f"  {k} RSS {mb:.0f} -> {servers[k].rss_mb():.0f} MB", file=sys.stderr)
                results.append({"target": f"{k} rss_mb", "concurrency": c, "before": mb,
                                 "after": servers[k].rss_mb()})
        soak: list[tuple[float, float, float]] = []  # (s since start, RSS MB, req/s)
        if args.soak > 0:
            label, server, path, body, ctype = next(
                t for t in targets if t[0] == f"image ours w={max(args.workers)} "
                "attention=rollout")
            start = time.monotonic()
            while time.monotonic() - start < args.soak:
                lat, _, wall = hey(servers[server].url + path, body, ctype, 32, 10.0)
                soak.append((time.monotonic() - start, servers[server].rss_mb(),
                             len(lat) / wall))
                print(f"  soak {soak[-1][0]:5.0f}s RSS {soak[-1][1]:.0f} MB "
                      f"{soak[-1][2]:.0f} req/s", file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()

    # --- report ---------------------------------------------------------------------------------
    header = (f"{'target':36s} {'c':>3s} {'p50':>7s} {'p95':>7s} {'p99':>7s} {'max':>7s} "
              f"{'req/s':>7s} {'batch':>5s} {'limit':>6s} {'err':>4s}")
    lines = [header, "-" * len(header)]
    for r in results:
        if "req_per_s" not in r:
            continue
        lines.append(
            f"{r['target']:36s} {r['concurrency']:>3d} {r['p50_ms']:7.1f} {r['p95_ms']:7.1f} "
            f"{r['p99_ms']:7.1f} {r['max_ms']:7.1f} {r['req_per_s']:7.1f} "
            + (f"{r['mean_batch']:5.1f}" if "mean_batch" in r else f"{'-':>5s}")
            + f" {100 * r['of_forward_limit']:5.0f}% {r['errors']:>4d}")
    lines.append("")
    by = {(r["target"], r["concurrency"]): r for r in results if "req_per_s" in r}
    for task in ("image", "text"):
        for c in args.concurrency:
            best_mlflow = max((by[k] for k in by if k[1] == c and k[0].startswith(
                f"{task} mlflow")), key=lambda r: r["req_per_s"], default=None)
            for w in args.workers:
                none = by.get((f"{task} ours w={w} attention=none", c))
                roll = by.get((f"{task} ours w={w} attention=rollout", c))
                if none is None or roll is None:
                    continue
                line = (f"{task} c={c} ours w={w}: rollout costs "
                        f"{100 * (1 - roll['req_per_s'] / none['req_per_s']):.0f} % of none")
                if best_mlflow is not None:
                    line += (f"; rollout vs best mlflow ({best_mlflow['target'].split()[-1]}): "
                             f"x{roll['req_per_s'] / best_mlflow['req_per_s']:.2f} req/s, "
                             f"p99 x{roll['p99_ms'] / best_mlflow['p99_ms']:.2f}")
                lines.append(line)
    lines.append("")
    lines.append("our stages (mean ms per observation; decode/queue/serialise per request, "
                 "the others per batch group):")
    for label, st in stages.items():
        lines.append(f"  {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(st.items())))
    if soak:
        lines.append(f"soak (image, rollout, c=32, --workers {max(args.workers)}): RSS MB "
                     + " -> ".join(f"{mb:.0f}" for _, mb, _ in soak)
                     + f" over {soak[-1][0]:.0f} s, {sum(r for *_, r in soak) / len(soak):.0f}"
                     " req/s")
    lines.append("model forward limits (img or texts/s, batch 32, no HTTP; one process with "
                 f"all threads / one 1-thread process per core): {limit_detail}")
    from vit_service.precision import resolve_precision

    precision = resolve_precision("auto")  # what ours, mlflow's pyfunc and the limit ran in
    lines.append(f"precision of every forward above (inference_precision auto): {precision}")
    lines.append(f"load average (1 min) before/after: {load_before[0]:.2f} / "
                 f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print("\n".join(lines))

    report = {"models": models, "bundle": str(bundle), "results": results, "stages": stages,
              "soak": soak, "forward_limits": limits, "forward_limit_detail": limit_detail,
              "rounds": args.rounds, "seconds": args.seconds,
              "precision": precision,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "loadavg_1m_before": load_before[0],
                          "loadavg_1m_after": os.getloadavg()[0]},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "note": "hey and the servers share the machine's CPUs; targets alternate"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
