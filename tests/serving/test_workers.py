"""``vit-service serve --workers N``: one leader per home (job scheduler, registry poll), and
every worker serving the same model version after a reload (serving/workers.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from mlflow import MlflowClient

from serving.workers import Leadership
from tests.serving.procs import KEY, Server
from vit_service import tracking

HOLD = "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); " \
       "print('held', flush=True); time.sleep(120)"


def test_leadership_is_exclusive_and_passes_on_when_the_holder_dies(tmp_path: Path) -> None:
    path = tmp_path / "serving.lock"
    a, b = Leadership(path), Leadership(path)
    assert a.try_acquire() and a.is_leader
    assert not b.try_acquire() and not b.is_leader
    a.release()
    assert b.try_acquire()
    b.release()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        c = Leadership(path)
        assert not c.try_acquire()
        holder.kill()  # however the leader dies, the kernel drops its lock
        holder.wait(10)
        assert c.try_acquire()
    finally:
        holder.kill()
    assert Leadership(None).is_leader  # a single process always leads


def _health(server: Server) -> dict:
    return httpx.get(server.url + "/healthz", timeout=10).json()


def _sample(server: Server, n: int) -> dict[int, dict]:
    """GET /readyz and /healthz on fresh connections: the workers that answered, by pid."""
    seen: dict[int, dict] = {}
    for _ in range(n):
        h = _health(server)
        seen[h["pid"]] = {"leader": h["leader"],
                          "loaded": httpx.get(server.url + "/readyz", timeout=10).json()["loaded"]}
    return seen


def _listening(pid: int, port: int) -> set[str]:
    """The kernel sockets (``socket:[inode]``) that process ``pid`` listens on ``port`` with."""
    out = set()
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.fd >= 0:
            out.add(os.readlink(f"/proc/{pid}/fd/{c.fd}"))
    return out


def test_two_workers_one_leader_one_version(registry, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "MLFLOW_", "PROMETHEUS_"))}
    env.update({"VIT_SERVICE_HOME": str(home), "MLFLOW_TRACKING_URI": registry.uri,
                "VIT_SERVICE_API_KEY": KEY, "VIT_SERVICE_DEFAULT_IMAGE_MODEL": "reload-vit",
                "VIT_SERVICE_MODELS": json.dumps({"reload-vit": "models:/reload-vit@champion"}),
                "VIT_SERVICE_DATA_DIR": str(tmp_path / "data"), "LOG_LEVEL": "WARNING"})
    client = MlflowClient(registry.uri, registry.uri)
    server = Server(env, home, args=("--workers", "2"))
    server.start()
    try:
        deadline = time.monotonic() + 60  # both workers up (each loads the model)
        seen: dict[int, dict] = {}
        while time.monotonic() < deadline and len(seen) < 2:
            seen.update(_sample(server, 10))
        assert len(seen) == 2, seen
        assert sorted(s["leader"] for s in seen.values()) == [False, True]
        assert {s["loaded"]["reload-vit"] for s in seen.values()} == {"1"}
        if sys.platform.startswith("linux"):  # a listening socket of its own per worker
            port = int(server.url.rsplit(":", 1)[1])
            socks = [_listening(pid, port) for pid in seen]
            assert all(len(x) == 1 for x in socks) and socks[0] != socks[1], socks

        client.set_registered_model_alias("reload-vit", tracking.CHAMPION, "2")
        r = server.post("/v1/models/reload-vit/reload")  # lands on one of them
        assert r.status_code == 200 and r.json()["model"]["version"] == "2", r.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = _sample(server, 12)
            if {s["loaded"]["reload-vit"] for s in now.values()} == {"2"} and len(now) == 2:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"workers disagree on the version: {now}")

        # /metrics adds up the workers: every /healthz above is counted, whoever answered
        text = httpx.get(server.url + "/metrics", timeout=10).text
        total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vit_service_http_requests_total{")
                    and 'route="/healthz"' in line)
        assert total >= 20, total
        assert 'vit_service_model_loaded{model="reload-vit"} 1.0' in text

        leader = next(pid for pid, s in seen.items() if s["leader"])
        os.kill(leader, signal.SIGKILL)  # the leader dies; another process takes over
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                now = _sample(server, 6)
            except httpx.HTTPError:
                continue
            if any(s["leader"] for pid, s in now.items() if pid != leader):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("no new leader after the leader was killed")
        deadline = time.monotonic() + 90  # the supervisor restarts it, on a new socket
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                now.update(_sample(server, 6))
            if len(set(now) - {leader}) == 2:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the killed worker was not replaced: {now}")

        # the supervisor dies hard: its workers notice and exit (no orphan keeps the port)
        assert server.proc is not None
        workers = [w for w in psutil.Process(server.proc.pid).children()
                   if "resource_tracker" not in " ".join(w.cmdline())]
        assert len(workers) == 2, workers
        server.proc.kill()
        server.proc.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"orphaned workers still running: {alive}"
    finally:
        for w in psutil.Process().children(recursive=True):  # nothing outlives the test
            if "multiprocessing" in " ".join(w.cmdline()) or "vit_service.cli" in " ".join(
                    w.cmdline()):
                w.kill()
        client.set_registered_model_alias("reload-vit", tracking.CHAMPION, "1")
        server.stop()


def test_workers_start_together_on_an_empty_home(tmp_path: Path) -> None:
    """``serve --workers 3`` on a home that has no database yet: every worker creates its
    first-start state at once (the jobs table, MLflow's tables); none may die doing it."""
    import sqlite3

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "MLFLOW_", "PROMETHEUS_"))}
    env.update({"VIT_SERVICE_HOME": str(home), "VIT_SERVICE_API_KEY": KEY,
                "VIT_SERVICE_DATA_DIR": str(tmp_path / "data"), "LOG_LEVEL": "INFO"})
    server = Server(env, home, args=("--workers", "3"))
    server.start()
    try:
        deadline = time.monotonic() + 90
        seen: dict[int, dict] = {}
        while time.monotonic() < deadline and len(seen) < 3:
            seen.update(_sample(server, 10))
        assert len(seen) == 3, seen
        assert server.get("/v1/jobs").status_code == 200
    finally:
        server.stop()
    log = "\n".join(p.read_text() for p in home.glob("server-*.log"))
    assert "already exists" not in log and "died" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    for db, table in (("jobs.db", "jobs"), ("mlflow.db", "experiments")):
        with sqlite3.connect(home / db) as conn:
            n = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND "
                             "name = ?", (table,)).fetchone()[0]
        assert n == 1, (db, table)
