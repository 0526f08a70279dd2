"""Several API processes on one home (``vit-service serve --workers N``): one leader, one version.

Each uvicorn worker is a whole app (its own models, batcher and inference thread), so N
workers use N cores for HTTP, decoding and forwards at once. Two things must still happen once
per home, whatever the number of processes:

* **Leadership.** Only the process holding an exclusive ``flock`` on ``$HOME/serving.lock``
  runs the job scheduler and polls the model registry. The kernel drops the lock when its
  holder dies, however it dies, and the other workers try to take it every couple of seconds,
  so a killed leader is replaced without a restart (the new one re-adopts running jobs, as after
  any restart). When the jobs database is PostgreSQL the job scheduler's lock is a
  session-level advisory lock in that database instead (:class:`PgLeadership`): one scheduler
  among every API process of every host sharing it; the registry poll stays per home (each
  host's processes serve their own copies of the models).
* **One model version.** A process that swaps a model in (the leader's registry poll, or a
  ``POST /v1/models/{name}/reload`` that landed on any worker) publishes the source's
  fingerprint (``name/version`` for a registry alias) in ``$HOME/serving-models.json``. Every
  worker watches that file (a ``stat`` every ``interval``) and refreshes a model whose published
  fingerprint differs from the one it serves; refreshing re-resolves the source, so all of them
  end on the registry's current version (and one that finds a newer one publishes it in turn).

Both are on when the app is one of several workers (``Settings.workers`` > 1, which ``serve``
exports to its workers); a single process follows nobody, and leads alone unless the jobs
database is PostgreSQL (other hosts may share it: it takes the database's lock too).

**Balanced connections**: on Linux each worker listens on a ``SO_REUSEPORT`` socket of its
own, and the kernel spreads connections over them (:mod:`serving.sockets`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import IO

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from serving.model_store import ModelLoadError, ModelStore
from vit_service.config import Settings

log = logging.getLogger(__name__)


def prepare_home(settings: Settings) -> None:
    """The first-start state of a home, made once by the supervisor before its workers start
    (they would otherwise all find no table and all create it): the jobs table and, for a
    local SQLite tracking store, MLflow's tables. Each is also safe to make concurrently
    (both are made under a lock), this just keeps N workers from waiting on each other."""
    from serving.jobs.store import JobStore
    from vit_service.tracking import init_sqlite_store

    JobStore(settings.resolved_jobs_db_url).engine.dispose()
    init_sqlite_store(settings.resolved_tracking_uri)


class Leadership:
    """An exclusive, non-blocking ``flock`` on ``path``; held until :meth:`release` or exit.
    ``path=None``: a single process (``--workers 1``), always the leader."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: IO[str] | None = None
        self._single = path is None

    @property
    def is_leader(self) -> bool:
        return self._single or self._fd is not None

    @property
    def where(self) -> str:
        """What is led, for the logs."""
        return str(self.path) if self.path is not None else "this process alone"

    def check(self) -> bool:
        """Whether the hold still stands: a held ``flock`` cannot be lost while its file
        descriptor is open, so this is :attr:`is_leader`."""
        return self.is_leader

    def try_acquire(self) -> bool:
        if self.is_leader:
            return True
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open(self.path, "a+")  # noqa: SIM115 (held open for as long as we lead)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fd.close()
            return False
        fd.seek(0)
        fd.truncate()
        fd.write(f"{os.getpid()}\n")
        fd.flush()
        self._fd = fd
        log.info("process %d leads %s (job scheduler, registry poll)", os.getpid(), self.path)
        return True

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._fd.close()
            self._fd = None


LEADER_LOCK_KEY = 0x7669746C  # "vitl": the advisory lock id of the leadership (store.py has the
# schema's, "vits"); advisory locks are per database, so each jobs database has its own leader

# libpq options of the leader's connection: the client notices a dead server or network within
# about 10 s (a ping that is not acknowledged by then fails), and the server drops a silent
# client, and with it the lock, within about 11 s (5 s idle, then 3 probes 2 s apart) instead
# of the kernel's default 2 hours: so the old leader has stepped down before another can lead.
_LIBPQ_KEEPALIVE = {
    "connect_timeout": 5, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
    "keepalives_count": 3, "tcp_user_timeout": 10_000,
    "options": "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 "
               "-c tcp_keepalives_count=3",
}


class PgLeadership:
    """Leadership by ``pg_try_advisory_lock`` in the jobs database, when that is PostgreSQL.

    Why not the ``flock``: it is per machine, so two API hosts sharing one database would each
    elect a leader and run two schedulers. The advisory lock is taken on a connection of its own
    (outside the store's pool) and held for as long as this process leads. It is a session lock:
    PostgreSQL releases it when that connection ends, however the holder dies (a killed process
    closes its socket at once; a vanished host is dropped by the server's keepalive probes).
    The connection is in autocommit, so it never sits idle in a transaction.

    The holder must notice when it loses the connection (a database restart, an administrator's
    ``pg_terminate_backend``, a network cut) and stop leading, since another process can take the
    lock at once: :meth:`check` pings the connection (the server lifespan calls it every
    ``leader_check_s`` and steps down when it answers False).

    The connection must be a direct session to PostgreSQL: a transaction-pooling proxy
    (PgBouncer in ``transaction`` mode) would hand the lock's session to other clients.
    """

    def __init__(self, url: str, key: int = LEADER_LOCK_KEY) -> None:
        self.key = key
        u = make_url(url)
        self.where = (f"PostgreSQL database {u.database!r} on {u.host or 'its socket'} "
                      f"(advisory lock {key:#x})")
        connect_args: dict[str, object] = {}
        if u.get_driver_name() in ("psycopg2", "psycopg"):  # libpq-based drivers
            name = f"vit-service leader {socket.gethostname()}:{os.getpid()}"[:63]
            connect_args = {**_LIBPQ_KEEPALIVE, "application_name": name}
        self._engine = create_engine(u, poolclass=NullPool, isolation_level="AUTOCOMMIT",
                                     connect_args=connect_args)
        self._conn: Connection | None = None  # kept between attempts: one connection a process
        self._held = False
        self._unreachable = False  # the last attempt could not reach the database (logged)
        self._lock = threading.Lock()  # calls come from threads (asyncio.to_thread)

    @property
    def is_leader(self) -> bool:
        return self._held

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False also when the database cannot be reached."""
        with self._lock:
            if self._held:
                return True
            try:
                if self._conn is None:
                    self._conn = self._engine.connect()
                got = bool(self._conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                              {"k": self.key}).scalar())
            except SQLAlchemyError as e:
                if not self._unreachable:  # once per outage, not every retry
                    log.warning("cannot reach %s for the leadership (retrying): %s", self.where,
                                _first_line(e))
                self._unreachable = True
                self._drop()
                return False
            self._unreachable = False
            if got:
                self._held = True
                log.info("process %d leads %s (job scheduler, registry poll)", os.getpid(),
                         self.where)
            return got

    def check(self) -> bool:
        """Whether this process still leads: a ``SELECT 1`` on the lock's connection (an open
        session still holds its session lock). A failed ping drops the connection: the lock
        is gone with it (or will be as soon as the server notices), so we no longer lead."""
        with self._lock:
            if not self._held or self._conn is None:
                return False
            try:
                self._conn.execute(text("SELECT 1"))
            except SQLAlchemyError as e:
                log.warning("process %d lost its connection to %s, and with it the leadership: "
                            "%s", os.getpid(), self.where, _first_line(e))
                self._drop()
                return False
            return True

    def release(self) -> None:
        """Stop leading: unlock and close (closing alone would release it too)."""
        with self._lock:
            if self._held and self._conn is not None:
                with contextlib.suppress(SQLAlchemyError):
                    self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            self._drop()

    def _drop(self) -> None:
        self._held = False
        if self._conn is not None:
            with contextlib.suppress(Exception):  # a dead connection may fail to close
                self._conn.close()
            self._conn = None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def leadership_for(settings: Settings) -> Leadership | PgLeadership:
    """The leadership of an API process: the jobs database's advisory lock when that is
    PostgreSQL (one scheduler for every process and host on it, even a single process), else
    the home's ``flock`` for one of ``serve --workers N``'s processes, else none (a single
    process on SQLite leads alone)."""
    url = settings.resolved_jobs_db_url
    if make_url(url).get_backend_name() == "postgresql":
        return PgLeadership(url)
    several = (settings.workers or 1) > 1
    return Leadership(settings.home / "serving.lock" if several else None)


class ModelSync:
    """The served versions shared by the processes of one home (module docstring)."""

    def __init__(self, path: Path, store: ModelStore) -> None:
        self.path = path
        self.store = store
        self._seen: int | None = None  # mtime_ns of the file when last read

    def read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def publish(self, name: str, fingerprint: str) -> None:
        """Record that ``name`` now serves ``fingerprint`` (atomic replace, under a lock)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.read()
            if data.get(name) == fingerprint:
                return
            data[name] = fingerprint
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, sort_keys=True))
            tmp.replace(self.path)

    async def follow_once(self) -> list[str]:
        """Refresh the models whose published fingerprint differs from ours; their names."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return []
        if mtime == self._seen:
            return []
        self._seen = mtime
        changed = []
        for name, fingerprint in self.read().items():
            if not self.store.is_configured(name):
                self.store.add_discovered(name)  # the leader discovered its champion
            current = self.store.get(name)
            if current is not None and current.resolved.fingerprint == fingerprint:
                continue
            try:
                result = await self.store.refresh(name)
            except ModelLoadError:
                continue  # logged by the store; retried when the file moves again
            if result.reloaded:
                changed.append(name)
        return changed

    async def follow_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.follow_once()
            except Exception:  # never let the watcher die
                log.exception("following %s failed", self.path)
            await asyncio.sleep(interval_s)


async def exit_with_parent(parent: int | None, interval_s: float = 1.0) -> None:
    """A worker whose supervisor ``parent`` died (even by SIGKILL, even before this worker had
    started) shuts down instead of serving on as an orphan that holds the port and the
    leadership: SIGTERM to itself, uvicorn's graceful exit."""
    parent = parent or os.getppid()
    while True:
        if os.getppid() != parent:
            log.warning("the server process %d is gone: worker %d shuts down", parent,
                        os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)
            return
        await asyncio.sleep(interval_s)

