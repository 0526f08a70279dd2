"""Several API hosts on one PostgreSQL jobs database, on a real server
(tests/serving/jobs/postgres_server.py): one leader by advisory lock, across processes and
hosts; a leader that dies or loses its connection is replaced; the jobs of a dead host are
settled only once its lease has expired, and nothing queued is lost."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from sqlalchemy.engine import make_url

from serving.jobs.local import alive
from serving.jobs.model import Job, JobState
from serving.jobs.store import JobStore
from serving.workers import (
    LEADER_LOCK_KEY,
    Leadership,
    PgLeadership,
    leadership_for,
    prepare_home,
)
from tests.serving.jobs.postgres_server import PostgresServer
from tests.serving.procs import Server, jobs_env
from vit_service.config import Settings

# a process that takes the leader's lock as PgLeadership does (a session lock on a connection
# of its own) and holds it until it is killed; plain psycopg2, so it starts in a blink
HOLD = """import sys, time, psycopg2
conn = psycopg2.connect(sys.argv[1])
conn.autocommit = True
cur = conn.cursor()
cur.execute("SELECT pg_try_advisory_lock(%s)", (int(sys.argv[2]),))
print("held" if cur.fetchone()[0] else "busy", flush=True)
time.sleep(120)
"""


def _holder(postgres: PostgresServer, database: str) -> int | None:
    """The backend pid holding the leader's lock in ``database``, if any."""
    rows = postgres.execute(
        "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
        f"WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 "
        f"AND l.objid = {LEADER_LOCK_KEY} AND d.datname = '{database}'")
    return rows[0][0] if rows else None


def _wait(what: str, cond: Callable[[], object], timeout: float,
          every: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if got := cond():
                return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_one_leader_per_database_and_it_is_replaced(postgres: PostgresServer, pg_url: str,
                                                    tmp_path: Path) -> None:
    db = make_url(pg_url).database
    assert db is not None
    # on PostgreSQL every API process takes the database's lock, one alone or one of several;
    # on SQLite the home's flock for several, none for one
    for workers in (None, 1, 3):
        assert isinstance(leadership_for(Settings(home=tmp_path, jobs_db_url=pg_url,
                                                  workers=workers)), PgLeadership)
    flock = leadership_for(Settings(home=tmp_path, jobs_db_url=None, workers=2))
    assert isinstance(flock, Leadership) and flock.path == tmp_path / "serving.lock"
    assert leadership_for(Settings(home=tmp_path, jobs_db_url=None, workers=1)).is_leader

    a, b = PgLeadership(pg_url), PgLeadership(pg_url)
    held: list[PgLeadership] = [a, b]
    holder = None
    try:
        assert a.try_acquire() and a.is_leader and a.check()
        assert not b.try_acquire() and not b.is_leader and not b.check()
        a.release()
        assert not a.is_leader and _holder(postgres, db) is None
        assert b.try_acquire() and not a.try_acquire()
        b.release()

        # a leader process killed outright: PostgreSQL ends its session, the lock goes with it
        dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
        holder = subprocess.Popen([sys.executable, "-c", HOLD, dsn, str(LEADER_LOCK_KEY)],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        c = PgLeadership(pg_url)
        held.append(c)
        assert not c.try_acquire()
        holder.kill()
        t0 = time.monotonic()
        _wait("the lock of the killed holder", c.try_acquire, timeout=5)
        print(f"\ntaken over {time.monotonic() - t0:.2f} s after the holder was killed")

        # a leader whose connection is ended from the server side notices and steps down
        victim = _holder(postgres, db)
        assert victim is not None
        postgres.execute(f"SELECT pg_terminate_backend({victim})")
        _wait("the backend to end", lambda: _holder(postgres, db) is None, timeout=5)
        assert not c.check() and not c.is_leader
        d = PgLeadership(pg_url)
        held.append(d)
        assert d.try_acquire() and not c.try_acquire()  # c reconnects, finds it taken
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
        for leadership in held:
            leadership.release()


# --- two API hosts on one database ---------------------------------------------------------------

LEASE_S = 6.0
SHORT = {"epochs": 1, "data.subset": 96, "attention_samples": 0}
LONG = {"epochs": 400, "data.subset": 96, "attention_samples": 0}


def _health(server: Server) -> dict:
    return httpx.get(server.url + "/healthz", timeout=5).json()


def _leader(servers: list[Server]) -> Server | None:
    """The one server that says it leads; None unless exactly one does."""
    leading = [s for s in servers if _health(s)["leader"]]
    return leading[0] if len(leading) == 1 else None


def _job(server: Server, job_id: str) -> dict:
    r = server.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _wait_done(server: Server, job_id: str, store: JobStore, timeout: float) -> None:
    """Wait for ``job_id`` to succeed; a job that ends otherwise, or is still not done at the
    deadline, fails the test at once with its state, reason, host and the end of its log (a
    bare timeout said nothing of why)."""
    deadline = time.monotonic() + timeout
    state = "unknown"
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            state = _job(server, job_id)["state"]
            if state == "succeeded":
                print(f"\njob {job_id} succeeded {timeout - (deadline - time.monotonic()):.1f} s "
                      "into the wait")
                return
            if state in ("failed", "cancelled"):
                break
        time.sleep(0.5)
    job = store.get(job_id)
    tail = job.log_path.read_text()[-3000:] if job is not None and job.log_path.exists() else ""
    servers = "".join(f"\n--- {p.name} ends:\n{p.read_text()[-1500:]}"
                      for p in sorted(server.home.glob("server-*.log")))
    raise AssertionError(
        f"job {job_id} is {state} after {timeout - max(0.0, deadline - time.monotonic()):.0f} s "
        f"(host {job.host if job else None}, attempts {job.attempts if job else None}, "
        f"reason {job.reason if job else None!r}); its log ends:\n{tail}{servers}")


def _launches(job: Job) -> list[str]:
    """The launch lines of the job's log: one per attempt started."""
    return [ln for ln in job.log_path.read_text().splitlines() if ln.startswith("# ")]


def _kill_group(job: Job | None) -> None:
    if job is not None and job.pid is not None and alive(job.pid, job.pid_start):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)


def test_two_api_hosts_on_one_database(postgres: PostgresServer, pg_url: str,
                                       tmp_path: Path) -> None:
    """Two `vit-service serve` processes as two hosts (their own host ids) on one PostgreSQL
    database and one shared home (the runs folder a real deployment shares on a shared
    filesystem): one leads and starts every job once; its connection ended, it steps down;
    the leading host killed (API and job), the other leads, leaves the dead host's job running
    until its lease expired, then settles it (resumable), and runs what was queued."""
    home = tmp_path / "home"
    env = jobs_env(tmp_path, VIT_SERVICE_JOBS_DB_URL=pg_url,
                   VIT_SERVICE_JOBS_LEASE_S=str(LEASE_S), VIT_SERVICE_JOBS_CONCURRENCY="1",
                   VIT_SERVICE_LEADER_CHECK_S="0.3", VIT_SERVICE_MODELS="{}")
    servers = [Server({**env, "VIT_SERVICE_JOBS_HOST_ID": f"host-{n}"}, home) for n in "ab"]
    for s, n in zip(servers, "ab", strict=True):
        s.host_id = f"host-{n}"  # type: ignore[attr-defined]
    store = JobStore(pg_url)  # the test's own look at the table (hosts, pids, leases)
    db = make_url(pg_url).database
    # the first-start state once (as `serve --workers N` makes it): two servers starting
    # together on a fresh home would race MLflow's migrations of its SQLite file
    prepare_home(Settings(home=home, jobs_db_url=pg_url, tracking_uri=env["MLFLOW_TRACKING_URI"]))
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Server.start, servers))
        leader = _wait("one leader", lambda: _leader(servers), timeout=10)
        assert isinstance(leader, Server)

        # the leader's lock connection is ended: it notices, steps down, someone leads again
        victim = _holder(postgres, db)
        assert victim is not None
        postgres.execute(f"SELECT pg_terminate_backend({victim})")
        _wait("a new lock holder", lambda: _holder(postgres, db) not in (None, victim),
              timeout=10)
        leader = _wait("one leader again", lambda: _leader(servers), timeout=10)
        assert isinstance(leader, Server)
        # (whoever leads now, the one that lost the lock said so)
        _wait("the step-down in a log", lambda: any(
            "no longer leads" in p.read_text() for p in home.glob("server-*.log")), timeout=5)
        follower = next(s for s in servers if s is not leader)

        # jobs submitted through both APIs: each started once, by the leader's host
        def submit(server: Server, overrides: dict) -> str:
            r = server.post("/v1/jobs", json={"recipe": "cifar10-smoke", "overrides": overrides})
            assert r.status_code == 202, r.text
            return r.json()["id"]

        short = [submit(servers[0], SHORT), submit(servers[1], SHORT)]
        long_id = submit(servers[0], LONG)
        queued = submit(servers[1], SHORT)
        for job_id in short:
            _wait_done(follower, job_id, store, timeout=180)
            job = store.get(job_id)
            assert job is not None and job.attempts == 1 and len(_launches(job)) == 1
            assert job.host == leader.host_id  # type: ignore[attr-defined]
        _wait("the long job's first step", lambda: (_job(follower, long_id)["progress"]
                                                    .get("step") or 0) >= 1,
              timeout=120, every=0.3)
        assert _job(follower, queued)["state"] == "queued"

        # the leading host dies: its API and its job, at once
        long_job = store.get(long_id)
        assert long_job is not None and long_job.host == leader.host_id  # type: ignore
        assert leader.proc is not None
        leader.proc.kill()
        _kill_group(long_job)
        killed = time.monotonic()
        leader.proc.wait(10)
        _wait("the other host to lead", lambda: _health(follower)["leader"], timeout=10)
        took_over = time.monotonic() - killed
        # still running: its lease has not expired yet (renewed up to LEASE_S / 3 before)
        assert _job(follower, long_id)["state"] == "running"
        settled = _wait("the dead host's job to be settled",
                        lambda: _job(follower, long_id)["state"] != "running",
                        timeout=LEASE_S * 3)
        assert settled
        gone = store.get(long_id)
        assert gone is not None and gone.state == JobState.failed
        assert gone.finished_at is not None and gone.heartbeat_at is not None
        assert (gone.finished_at - gone.heartbeat_at).total_seconds() >= LEASE_S
        assert "stopped renewing its lease" in (gone.reason or "")
        assert f"/v1/jobs/{long_id}/resume" in (gone.reason or "")
        print(f"\nthe other host led {took_over:.1f} s after the kill; the dead host's job "
              f"was settled {time.monotonic() - killed:.1f} s after it (lease {LEASE_S} s)")

        # what was queued runs on the survivor, once; the settled job resumes there
        _wait_done(follower, queued, store, timeout=180)
        done = store.get(queued)
        assert done is not None and done.attempts == 1 and len(_launches(done)) == 1
        assert done.host == follower.host_id  # type: ignore[attr-defined]
        r = follower.post(f"/v1/jobs/{long_id}/resume")
        assert r.status_code == 202, r.text
        _wait("the resumed job to start on the survivor",
              lambda: _job(follower, long_id)["state"] == "running", timeout=30)
        again = store.get(long_id)
        assert again is not None and again.attempts == 2
        assert again.host == follower.host_id  # type: ignore[attr-defined]
    finally:
        for s in servers:
            s.stop()
        for job in store.list(limit=1000):
            _kill_group(job)
        store.engine.dispose()
