"""Job records in a real database (SQLite by default, any SQLAlchemy URL, PostgreSQL in docker)."""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Engine,
    Integer,
    String,
    Text,
    create_engine,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


class JobState(str, enum.Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class _Base(DeclarativeBase):
    pass


class _JobRow(_Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    recipe: Mapped[str] = mapped_column(String(100))
    overrides: Mapped[dict] = mapped_column(JSON, default=dict)
    nprocs: Mapped[int] = mapped_column(Integer, default=1)
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pid_start: Mapped[str | None] = mapped_column(String(32), nullable=True)  # pid-reuse guard
    run_dir: Mapped[str] = mapped_column(Text)
    resume: Mapped[int] = mapped_column(Integer, default=0)  # 1: next start resumes
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    progress: Mapped[dict] = mapped_column(JSON, default=dict)
    # where the current attempt runs, set once that executor accepted it: local | ray
    executor: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # the API host running a local job, and its lease: renewed while that host follows the
    # job; another host settles the job only once the lease has expired
    host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                          nullable=True)


# columns added after the first release: (name, DDL type), added to older tables on start-up
_ADDED_COLUMNS = (("executor", "VARCHAR(16)"), ("host", "VARCHAR(200)"),
                  ("heartbeat_at", "TIMESTAMP"))


@dataclass
class JobRecord:
    """A detached, plain copy of one job row."""

    id: str
    name: str
    recipe: str
    overrides: dict[str, Any]
    nprocs: int
    state: JobState
    created_at: datetime
    run_dir: str
    started_at: datetime | None = None
    finished_at: datetime | None = None
    exit_code: int | None = None
    reason: str | None = None
    pid: int | None = None
    pid_start: str | None = None
    resume: bool = False
    attempts: int = 0
    mlflow_run_id: str | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    executor: str | None = None
    host: str | None = None
    heartbeat_at: datetime | None = None

    @property
    def log_path(self) -> Path:
        return Path(self.run_dir) / "job.log"


def _record(row: _JobRow) -> JobRecord:
    def aware(d: datetime | None) -> datetime | None:  # SQLite drops tzinfo
        return d.replace(tzinfo=timezone.utc) if d is not None and d.tzinfo is None else d

    return JobRecord(
        id=row.id, name=row.name, recipe=row.recipe, overrides=dict(row.overrides or {}),
        nprocs=row.nprocs, state=JobState(row.state), created_at=aware(row.created_at),
        run_dir=row.run_dir, started_at=aware(row.started_at), finished_at=aware(row.finished_at),
        exit_code=row.exit_code, reason=row.reason, pid=row.pid, pid_start=row.pid_start,
        resume=bool(row.resume), attempts=row.attempts, mlflow_run_id=row.mlflow_run_id,
        progress=json.loads(json.dumps(row.progress or {})), executor=row.executor,
        host=row.host, heartbeat_at=aware(row.heartbeat_at),
    )


def _column_values(values: dict[str, Any]) -> dict[str, Any]:
    """Record fields as the table stores them: states by value, ``resume`` as 0/1."""
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
    """Thread-safe CRUD over the jobs table (each call opens its own session)."""

    def __init__(self, url: str) -> None:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = create_engine(url, pool_pre_ping=True, **kwargs)
        with _schema_lock(self.engine, url):
            _Base.metadata.create_all(self.engine)
            self._add_missing_columns()
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def create(
        self, *, name: str, recipe: str, overrides: dict[str, Any], nprocs: int, runs_root: Path
    ) -> JobRecord:
        job_id = uuid.uuid4().hex[:12]
        row = _JobRow(
            id=job_id, name=name or f"{recipe}-{job_id}", recipe=recipe, overrides=overrides,
            nprocs=nprocs, state=JobState.queued.value, created_at=utcnow(),
            run_dir=str((runs_root / f"job-{job_id}").resolve()), progress={},
        )
        with self._session.begin() as s:
            s.add(row)
        return self.get(job_id)

    def get(self, job_id: str) -> JobRecord | None:
        with self._session() as s:
            row = s.get(_JobRow, job_id)
            return _record(row) if row is not None else None

    def list(self, state: JobState | None = None, limit: int = 100) -> list[JobRecord]:
        q = select(_JobRow).order_by(_JobRow.created_at.desc()).limit(limit)
        if state is not None:
            q = q.where(_JobRow.state == state.value)
        with self._session() as s:
            return [_record(r) for r in s.scalars(q)]

    def oldest_queued(self) -> JobRecord | None:
        q = (select(_JobRow).where(_JobRow.state == JobState.queued.value)
             .order_by(_JobRow.created_at).limit(1))
        with self._session() as s:
            row = s.scalars(q).first()
            return _record(row) if row is not None else None

    def update(self, job_id: str, **values: Any) -> JobRecord:
        values = _column_values(values)
        with self._session.begin() as s:
            row = s.get(_JobRow, job_id)
            if row is None:
                raise KeyError(job_id)
            for k, v in values.items():
                setattr(row, k, v)
        return self.get(job_id)

    def transition(self, job_id: str, expect: set[JobState], **values: Any) -> JobRecord | None:
        """Update only if the job is in one of ``expect`` states (compare-and-set).

        One conditional ``UPDATE ... WHERE id = ? AND state IN (...)``: atomic in every
        database, so of two schedulers (two API processes on one database) claiming the same
        queued job, exactly one sees a row updated."""
        values = _column_values(values)
        q = (update(_JobRow).where(_JobRow.id == job_id)
             .where(_JobRow.state.in_([e.value for e in expect])).values(**values))
        with self._session.begin() as s:
            if s.execute(q).rowcount != 1:
                return None
        return self.get(job_id)

    def heartbeat(self, job_ids: list[str], host: str) -> None:
        """Renew the lease of ``host``'s running jobs (one UPDATE)."""
        if not job_ids:
            return
        q = (update(_JobRow).where(_JobRow.id.in_(job_ids)).where(_JobRow.host == host)
             .where(_JobRow.state == JobState.running.value).values(heartbeat_at=utcnow()))
        with self._session.begin() as s:
            s.execute(q)

    def _add_missing_columns(self) -> None:
        """A jobs table from an older release gets the columns added since (no data moves)."""
        have = {c["name"] for c in inspect(self.engine).get_columns(_JobRow.__tablename__)}
        with self.engine.begin() as conn:
            for name, ddl in _ADDED_COLUMNS:
                if name not in have:
                    table = _JobRow.__tablename__
                    conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}"))
