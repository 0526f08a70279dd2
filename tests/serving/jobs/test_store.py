"""JobStore: the claim is one atomic compare-and-set across processes; older tables migrate.
Each on SQLite and on a real PostgreSQL server (tests/serving/jobs/postgres_server.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    text,
)

from serving.jobs.store import JobState, JobStore, utcnow


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new jobs database: a SQLite file, or a fresh database on the test PostgreSQL."""
    if request.param == "postgres":
        yield request.getfixturevalue("pg_url")
    else:
        yield f"sqlite:///{tmp_path / 'jobs.db'}"


def test_two_stores_claim_a_queued_job_exactly_once(db_url: str, tmp_path: Path) -> None:
    a, b = JobStore(db_url), JobStore(db_url)  # two API processes on one database
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


def _first_release_table() -> Table:
    """The jobs table as the first release created it."""
    return Table(
        "jobs", MetaData(),
        Column("id", String(32), primary_key=True), Column("name", String(200)),
        Column("recipe", String(100)), Column("overrides", JSON), Column("nprocs", Integer),
        Column("state", String(16)), *(Column(c, DateTime(timezone=True)) for c in (
            "created_at", "started_at", "finished_at")),
        Column("exit_code", Integer), Column("reason", Text), Column("pid", Integer),
        Column("pid_start", String(32)), Column("run_dir", Text), Column("resume", Integer),
        Column("attempts", Integer), Column("mlflow_run_id", String(64)),
        Column("progress", JSON))


def test_an_older_table_gets_the_new_columns(db_url: str) -> None:
    old_table = _first_release_table()
    created = datetime(2026, 1, 1, tzinfo=UTC)
    engine = create_engine(db_url)
    old_table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(old_table.insert().values(
            id="abc", name="n", recipe="r", overrides={}, nprocs=1, state="succeeded",
            created_at=created, exit_code=0, run_dir="/x", resume=0, attempts=1, progress={}))
    engine.dispose()
    store = JobStore(db_url)
    old = store.get("abc")
    assert old is not None and old.state == JobState.succeeded and old.executor is None
    assert old.created_at == created and old.created_at.utcoffset() == timedelta(0)
    assert old.priority == 0  # rows from before priorities: the default
    assert store.update("abc", executor="ray").executor == "ray"
    # the added timestamp keeps its zone (a bare TIMESTAMP on PostgreSQL would shift it by
    # the server's time zone, which is not UTC in these tests)
    beat = utcnow().replace(microsecond=0)
    assert store.update("abc", heartbeat_at=beat).heartbeat_at == beat
    JobStore(db_url).engine.dispose()  # and opening it again is a no-op
    store.engine.dispose()


def test_overrides_stored_as_sent_are_read_once_as_a_submission_reads_them(
        db_url: str) -> None:
    """A release before typed overrides stored the values as sent, and its trainer read each
    by YAML rules when the job started: a queued job with ``"3"`` ran 3 epochs. Opening that
    table types them once, as a submission now does; a value that does not read stays as it
    was. A row that already makes a valid recipe (typed by a later release without the
    column) is left as it is, and a row marked typed is never read again."""
    old_table = _first_release_table()
    engine = create_engine(db_url)
    old_table.metadata.create_all(engine)
    sent = {"epochs": "3", "optim.lr": "1e-3", "optim.betas": "[0.9, 0.95]",
            "budget_minutes": "null", "register_as": "2024", "seed": 7,
            "batch_size": "2024-01-01"}
    typed = {"epochs": 3, "optim.betas": [0.9, 0.95], "description": "null"}
    with engine.begin() as conn:
        conn.execute(old_table.insert().values(
            id="q1", name="n", recipe="cifar10-smoke", overrides=sent, nprocs=1,
            state="queued", created_at=utcnow(), run_dir="/x", resume=0, attempts=0,
            progress={}))
        conn.execute(old_table.insert().values(  # typed by a release without the column
            id="t1", name="n", recipe="cifar10-smoke", overrides=typed, nprocs=1,
            state="queued", created_at=utcnow(), run_dir="/y", resume=0, attempts=0,
            progress={}))
    engine.dispose()
    store = JobStore(db_url)
    assert store.get("t1").overrides == typed
    job = store.get("q1")
    assert job is not None and job.overrides == {
        "epochs": 3, "optim.lr": 0.001, "optim.betas": [0.9, 0.95], "budget_minutes": None,
        "register_as": "2024", "seed": 7,  # a text field keeps its text; a number stays
        "batch_size": "2024-01-01"}  # a date is no JSON value: refused when the job starts
    store.update("q1", overrides={"model.overrides.pool": "on"})  # typed: the text "on"
    store.engine.dispose()
    again = JobStore(db_url)
    assert again.get("q1").overrides == {"model.overrides.pool": "on"}  # not read as True
    again.engine.dispose()


def test_a_bare_timestamp_heartbeat_from_an_earlier_release_is_made_zone_aware(
        db_url: str) -> None:
    """An earlier release added ``heartbeat_at`` as a bare TIMESTAMP; on PostgreSQL (whose
    server zone is not UTC in these tests) an aware value was stored in the session's zone and
    read back as if UTC. Opening the store turns the column into TIMESTAMPTZ, reading the
    stored values in that zone: the instant written before comes back."""
    JobStore(db_url).engine.dispose()  # today's table
    engine = create_engine(db_url)
    beat = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE jobs ALTER COLUMN heartbeat_at TYPE TIMESTAMP "
                              "USING heartbeat_at AT TIME ZONE 'UTC'"))
        conn.execute(text(
            "INSERT INTO jobs (id, name, recipe, overrides, nprocs, state, created_at, "
            "run_dir, resume, attempts, progress, priority, heartbeat_at) VALUES ('b', 'n', "
            "'r', '{}', 1, 'running', :t, '/x', 0, 1, '{}', 0, :t)"), {"t": beat})
    engine.dispose()
    store = JobStore(db_url)
    assert store.get("b").heartbeat_at == beat
    store.engine.dispose()
