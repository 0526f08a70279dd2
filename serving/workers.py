"""Several API processes on one home (``vit-service serve --workers N``): one leader, one version.

Each uvicorn worker is a whole app (its own models, batcher and inference thread), so N
workers use N cores for HTTP, decoding and forwards at once. Two things must still happen once
per home, whatever the number of processes:

* **Leadership.** Only the process holding an exclusive ``flock`` on ``$HOME/serving.lock``
  runs the job scheduler and polls the model registry. The kernel drops the lock when its
  holder dies, however it dies, and the other workers try to take it every couple of seconds,
  so a killed leader is replaced without a restart (the new one re-adopts running jobs, as after
  any restart).
* **One model version.** A process that swaps a model in (the leader's registry poll, or a
  ``POST /v1/models/{name}/reload`` that landed on any worker) publishes the source's
  fingerprint (``name/version`` for a registry alias) in ``$HOME/serving-models.json``. Every
  worker watches that file (a ``stat`` every ``interval``) and refreshes a model whose published
  fingerprint differs from the one it serves; refreshing re-resolves the source, so all of them
  end on the registry's current version (and one that finds a newer one publishes it in turn).

Both are on when the app is one of several workers (``Settings.workers`` > 1, which ``serve``
exports to its workers); a single process leads and follows nobody, as before.

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
from pathlib import Path
from typing import IO

from serving.model_store import ModelLoadError, ModelStore
from vit_service.config import Settings

log = logging.getLogger(__name__)


def prepare_home(settings: Settings) -> None:
    """The first-start state of a home, made once by the supervisor before its workers start
    (they would otherwise all find no table and all create it): the jobs table and, for a
    local SQLite tracking store, MLflow's tables. Each is also safe to make concurrently
    (the job store locks its schema), this just keeps N workers from racing at all."""
    from serving.jobs.store import JobStore

    JobStore(settings.resolved_jobs_db_url).engine.dispose()
    uri = settings.resolved_tracking_uri
    if uri.startswith("sqlite:///"):
        from mlflow import MlflowClient

        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        MlflowClient(uri, uri).search_experiments(max_results=1)  # runs MLflow's migrations


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

