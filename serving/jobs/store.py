"""Job records in a real database (SQLite by default, any SQLAlchemy URL, PostgreSQL in docker).

The table's columns are declared here; a row is read and written as a :class:`Job`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    Connection,
    DateTime,
    Engine,
    Integer,
    MetaData,
    Row,
    String,
    Table,
    Text,
    create_engine,
    insert,
    inspect,
    select,
    text,
    update,
)

from serving.jobs.model import Job, JobState
from serving.jobs.validation import typed_overrides
from training.recipes import load_recipe, setting_texts


def utcnow() -> datetime:
    return datetime.now(UTC)


_metadata = MetaData()


def _when(name: str, nullable: bool = True) -> Column:
    return Column(name, DateTime(timezone=True), nullable=nullable)


jobs = Table(
    "jobs", _metadata,
    Column("id", String(32), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("recipe", String(100), nullable=False),
    Column("overrides", JSON, nullable=False, default=dict),
    Column("nprocs", Integer, nullable=False, default=1),
    Column("state", String(16), nullable=False, index=True),
    _when("created_at", nullable=False), _when("started_at"), _when("finished_at"),
    Column("exit_code", Integer),
    Column("reason", Text),
    Column("pid", Integer),
    Column("pid_start", String(32)),  # pid-reuse guard
    Column("run_dir", Text, nullable=False),
    Column("resume", Integer, nullable=False, default=0),  # 1: next start resumes
    Column("attempts", Integer, nullable=False, default=0),
    Column("mlflow_run_id", String(64)),
    Column("progress", JSON, nullable=False, default=dict),
    # where the current attempt runs, set once that executor accepted it: local | ray
    Column("executor", String(16)),
    Column("host", String(200)),  # the lease: see Job.host
    _when("heartbeat_at"),
    Column("priority", Integer, nullable=False, default=0),  # higher starts first
    Column("owner", String(64)),  # the submitting API key's principal; NULL: before owners
    # 1: typed (written by this release); 0: as sent, by an older one (see _type_old_overrides)
    Column("overrides_format", Integer, nullable=False, default=1, server_default=text("0")),
)

# columns added after the first release, added to older tables on start-up: (name, what follows
# the type, which is the table's own in the database's dialect: a timestamp with time zone on
# PostgreSQL, where a bare TIMESTAMP would shift every value by the server's time zone)
_ADDED_COLUMNS = (("executor", ""), ("host", ""), ("heartbeat_at", ""),
                  ("priority", " NOT NULL DEFAULT 0"), ("owner", ""),
                  ("overrides_format", " NOT NULL DEFAULT 0"))

# the admission order: higher priority first, then first come, first served
_QUEUE_ORDER = (jobs.c.priority.desc(), jobs.c.created_at, jobs.c.id)


def _job(row: Row) -> Job:
    def aware(d: datetime | None) -> datetime | None:
        """In UTC whatever the database gives: SQLite drops the zone (we wrote UTC), PostgreSQL
        answers in its session's time zone."""
        if d is None:
            return None
        return d.replace(tzinfo=UTC) if d.tzinfo is None else d.astimezone(UTC)

    values = dict(row._mapping)
    for k in ("created_at", "started_at", "finished_at", "heartbeat_at"):
        values[k] = aware(values[k])
    values["overrides"] = dict(values["overrides"] or {})
    values.pop("overrides_format")
    values["progress"] = json.loads(json.dumps(values["progress"] or {}))  # a detached copy
    return Job(**values)


def _column_values(values: dict[str, Any]) -> dict[str, Any]:
    """Job fields as the table stores them: states by value, ``resume`` as 0/1."""
    out = {k: v.value if isinstance(v, JobState) else v for k, v in values.items()}
    if "resume" in out:
        out["resume"] = int(bool(out["resume"]))
    return out


@contextlib.contextmanager
def _schema_lock(engine: Engine, url: str) -> Iterator[None]:
    """Creating the tables is check-then-create: several API processes starting at once on a
    new database (``serve --workers N`` on a fresh home, two hosts on one PostgreSQL) would
    each see no table and each create it, all but one failing. Serialise it: a file lock
    beside a SQLite file, an advisory lock on PostgreSQL (held on its own connection until
    the schema is made), nothing for an in-memory database."""
    if url.startswith("sqlite"):
        db = url.removeprefix("sqlite:///")
        if not db or db == ":memory:" or not url.startswith("sqlite:///"):
            yield
            return
        with open(f"{db}.schema-lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _SCHEMA_LOCK_KEY})
                conn.commit()
        return
    yield


_SCHEMA_LOCK_KEY = 0x76697473  # "vits": the advisory lock id of this schema


class JobStore:
    """Thread-safe CRUD over the jobs table (each call its own connection from the pool)."""

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = create_engine(url, pool_pre_ping=True, **kwargs)
        with _schema_lock(self.engine, url):
            _metadata.create_all(self.engine)
            self._add_missing_columns()

    def create(
        self, *, name: str, recipe: str, overrides: dict[str, Any], nprocs: int, runs_root: Path,
        priority: int = 0, owner: str | None = None,
    ) -> Job:
        job_id = uuid.uuid4().hex[:12]
        q = insert(jobs).values(
            id=job_id, name=name or f"{recipe}-{job_id}", recipe=recipe, overrides=overrides,
            nprocs=nprocs, state=JobState.queued.value, created_at=utcnow(), priority=priority,
            owner=owner,
            run_dir=str((runs_root / f"job-{job_id}").resolve()), progress={},
        )
        with self.engine.begin() as conn:
            conn.execute(q)
        return self.get(job_id)

    def get(self, job_id: str) -> Job | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return _job(row) if row is not None else None

    def list(self, state: JobState | None = None, limit: int = 100) -> list[Job]:
        q = select(jobs).order_by(jobs.c.created_at.desc()).limit(limit)
        if state is not None:
            q = q.where(jobs.c.state == state.value)
        with self.engine.connect() as conn:
            return [_job(r) for r in conn.execute(q)]

    def next_queued(self) -> Job | None:
        """The queued job admitted next (highest priority, then oldest)."""
        q = (select(jobs).where(jobs.c.state == JobState.queued.value)
             .order_by(*_QUEUE_ORDER).limit(1))
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
        return _job(row) if row is not None else None

    def queue_order(self) -> list[str]:
        """The queued jobs' ids in admission order."""
        q = (select(jobs.c.id).where(jobs.c.state == JobState.queued.value)
             .order_by(*_QUEUE_ORDER))
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(q)]

    def update(self, job_id: str, **values: Any) -> Job:
        if values:
            q = update(jobs).where(jobs.c.id == job_id).values(**_column_values(values))
            with self.engine.begin() as conn:
                found = conn.execute(q).rowcount == 1
        else:
            found = self.get(job_id) is not None
        if not found:
            raise KeyError(job_id)
        return self.get(job_id)

    def transition(self, job_id: str, expect: set[JobState], **values: Any) -> Job | None:
        """Update only if the job is in one of ``expect`` states (compare-and-set).

        One conditional ``UPDATE ... WHERE id = ? AND state IN (...)``: atomic in every
        database, so of two schedulers (two API processes on one database) claiming the same
        queued job, exactly one sees a row updated."""
        q = (update(jobs).where(jobs.c.id == job_id)
             .where(jobs.c.state.in_([e.value for e in expect]))
             .values(**_column_values(values)))
        with self.engine.begin() as conn:
            if conn.execute(q).rowcount != 1:
                return None
        return self.get(job_id)

    def heartbeat(self, job_ids: list[str], host: str) -> None:
        """Renew the lease of ``host``'s running jobs (one UPDATE)."""
        if not job_ids:
            return
        q = (update(jobs).where(jobs.c.id.in_(job_ids)).where(jobs.c.host == host)
             .where(jobs.c.state == JobState.running.value).values(heartbeat_at=utcnow()))
        with self.engine.begin() as conn:
            conn.execute(q)

    def _add_missing_columns(self) -> None:
        """A jobs table from an older release gets the columns added since (no data moves)."""
        columns = {c["name"]: c for c in inspect(self.engine).get_columns(jobs.name)}
        with self.engine.begin() as conn:
            for name, rest in _ADDED_COLUMNS:
                if name not in columns:
                    ddl = jobs.c[name].type.compile(dialect=self.engine.dialect) + rest
                    conn.execute(text(f"ALTER TABLE {jobs.name} ADD COLUMN {name} {ddl}"))
            # an earlier release added heartbeat_at as a bare TIMESTAMP: PostgreSQL stored the
            # aware values in the session's zone and they read back as UTC (leases expiring at
            # once, or never); the stored values are read in that zone
            beat = columns.get("heartbeat_at")
            if (self.engine.dialect.name == "postgresql" and beat is not None
                    and not getattr(beat["type"], "timezone", True)):
                conn.execute(text(
                    f"ALTER TABLE {jobs.name} ALTER COLUMN heartbeat_at TYPE TIMESTAMPTZ "
                    "USING heartbeat_at AT TIME ZONE current_setting('TimeZone')"))
            _type_old_overrides(conn)


def _type_old_overrides(conn: Connection) -> None:
    """Rows written by a release that has no ``overrides_format`` column (0): releases before
    typed overrides stored the values as sent, and the trainer read each by YAML rules when
    the job started (``"3"``: 3); later ones stored them typed, and a typed value is not to
    be read again (a string YAML reads as something else would change). The two cannot be
    told apart, but a typed row was checked against its recipe when it was submitted: a row
    whose values, as they stand, make a valid recipe is left as it is; only one that does not
    has each value read as a submission reads it (:func:`typed_overrides`), so a queued job
    runs as it would have. A value that does not read stays (the job is refused when it
    starts, the field named). Either way the row is marked 1 and never read again."""
    old = conn.execute(select(jobs.c.id, jobs.c.recipe, jobs.c.overrides)
                       .where(jobs.c.overrides_format == 0)).all()
    for job_id, recipe, overrides in old:
        values = dict(overrides or {})
        if not _stands(recipe, values):
            values = {k: _typed(k, v) for k, v in values.items()}
        conn.execute(update(jobs).where(jobs.c.id == job_id)
                     .values(overrides=values, overrides_format=1))


def _stands(recipe: str, overrides: dict[str, Any]) -> bool:
    """Whether ``overrides``, taken as typed values, make a valid ``recipe``."""
    try:
        load_recipe(recipe, setting_texts(overrides))
    except Exception:  # noqa: BLE001 - any failure: it does not stand as it is
        return False
    return True


def _typed(key: str, value: Any) -> Any:
    try:
        return typed_overrides({key: value})[key]
    except Exception:  # noqa: BLE001 - a row must never keep the server from starting
        return value
