"""JobStore: the claim is one atomic compare-and-set across processes; older tables migrate."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from serving.jobs.store import JobState, JobStore, utcnow


def test_two_stores_claim_a_queued_job_exactly_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    a, b = JobStore(url), JobStore(url)  # two API processes on one database
    ids = [a.create(name="", recipe="r", overrides={}, nprocs=1, runs_root=tmp_path).id
           for _ in range(20)]
    wins: dict[str, list[str]] = {i: [] for i in ids}
    start = threading.Barrier(2)

    def claim(store: JobStore, who: str) -> None:
        start.wait()
        for i in ids:
            if store.transition(i, {JobState.queued}, state=JobState.running,
                                started_at=utcnow()) is not None:
                wins[i].append(who)

    threads = [threading.Thread(target=claim, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(w) == 1 for w in wins.values()), wins
    assert {j.state for j in b.list()} == {JobState.running}
    assert a.transition(ids[0], {JobState.queued}, state=JobState.cancelled) is None


def test_an_older_table_gets_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:  # the jobs table as the first release created it
        conn.execute("""CREATE TABLE jobs (id VARCHAR(32) PRIMARY KEY, name VARCHAR(200),
            recipe VARCHAR(100), overrides JSON, nprocs INTEGER, state VARCHAR(16),
            created_at DATETIME, started_at DATETIME, finished_at DATETIME, exit_code INTEGER,
            reason TEXT, pid INTEGER, pid_start VARCHAR(32), run_dir TEXT, resume INTEGER,
            attempts INTEGER, mlflow_run_id VARCHAR(64), progress JSON)""")
        conn.execute("""INSERT INTO jobs VALUES ('abc', 'n', 'r', '{}', 1, 'succeeded',
            '2026-01-01 00:00:00', NULL, NULL, 0, NULL, NULL, NULL, '/x', 0, 1, NULL, '{}')""")
    store = JobStore(f"sqlite:///{db}")
    old = store.get("abc")
    assert old is not None and old.state == JobState.succeeded and old.executor is None
    assert old.priority == 0  # rows from before priorities: the default
    assert store.update("abc", executor="ray").executor == "ray"
    JobStore(f"sqlite:///{db}")  # and opening it again is a no-op
