"""The job scheduler: validates requests, runs each job as its own ``vit-service train`` process,
follows its JSON-lines progress, cancels it, and recovers after a server restart.

Jobs run in their own session (process group) with output to ``<run_dir>/job.log``, so they
survive a restart of the API server: on start-up the manager re-adopts live processes (checked by
pid *and* process start time), and marks jobs whose process is gone as failed, with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.jobs.metrics import read_series
from serving.jobs.store import JobRecord, JobState, JobStore, utcnow
from vit_service.config import Settings

log = logging.getLogger(__name__)

PATH_KEY_SUFFIXES = ("dir", "file", "path", "root", "uri")
SUCCESS_STATUSES = ("finished", "stopped", "succeeded")  # the trainer's "end" event


class JobError(Exception):
    """A request the manager refuses; ``status`` is the HTTP code the API should answer."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(str(detail))
        self.status, self.detail = status, detail


def _default_validate(recipe: str, overrides: dict[str, Any]) -> None:
    """Only known recipe *names* (never a path), overrides checked against the recipe schema."""
    from training.recipes import RecipeError, list_recipes, load_recipe

    known = list_recipes()
    if recipe not in known:
        raise JobError(422, f"unknown recipe {recipe!r}; known: {', '.join(known)}")
    try:
        load_recipe(recipe, overrides)
    except RecipeError as e:
        raise JobError(422, str(e)) from e


def _proc_start(pid: int) -> str | None:
    """Kernel start time of ``pid`` (guards against pid reuse), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _proc_start(pid)
    if now is None:
        return False
    with_state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return with_state != "Z" and (start is None or now == start)


@dataclass
class _Tracked:
    proc: subprocess.Popen | None  # None: adopted after a restart (not our child)
    pid: int
    pid_start: str | None
    offset: int = 0
    cancel_at: float | None = None  # monotonic time SIGTERM was sent
    killed: bool = False
    progress: dict[str, Any] = field(default_factory=dict)


class JobManager:
    def __init__(
        self,
        settings: Settings,
        store: JobStore | None = None,
        validate: Callable[[str, dict[str, Any]], None] = _default_validate,
    ) -> None:
        self.settings = settings
        self.store = store or JobStore(settings.resolved_jobs_db_url)
        self.validate = validate
        self.runs_root = (settings.home / "runs").resolve()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.concurrency = settings.jobs_concurrency or self._default_concurrency()

    @staticmethod
    def _default_concurrency() -> int:
        try:
            import torch

            return max(1, torch.cuda.device_count())
        except Exception:  # torch missing or CUDA probing failed
            return 1

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="job-scheduler", daemon=True)
        self._thread.start()
        log.info("job manager started: %d at once, database %s", self.concurrency,
                 self.store.engine.url.render_as_string(hide_password=True))

    def stop(self) -> None:
        """Stop scheduling. Running jobs keep running (they are re-adopted on the next start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def recover(self) -> None:
        for job in self.store.list(JobState.running, limit=10_000):
            if job.pid is not None and _alive(job.pid, job.pid_start):
                log.info("re-adopting running job %s (pid %d)", job.id, job.pid)
                with self._lock:
                    self._tracked[job.id] = _Tracked(None, job.pid, job.pid_start,
                                                     cancel_at=None)
                continue
            # it may have finished while the server was down: take its progress from the log
            self._read_progress(job.id, _Tracked(None, job.pid or 0, job.pid_start))
            self._finish_adopted(self._get(job.id),
                                 "the job's process was gone when the API server restarted")

    # --- API operations -------------------------------------------------------------------------
    def submit(self, recipe: str, overrides: dict[str, Any], name: str = "",
               nprocs: int = 1) -> JobRecord:
        if not 1 <= nprocs <= self.settings.jobs_max_procs:
            raise JobError(422, f"nprocs must be between 1 and {self.settings.jobs_max_procs}")
        self._check_paths(overrides)
        self.validate(recipe, overrides)
        self._admit(recipe, overrides, nprocs)
        job = self.store.create(name=name, recipe=recipe, overrides=overrides, nprocs=nprocs,
                                runs_root=self.runs_root)
        log.info("job %s queued: %s %s", job.id, recipe, overrides)
        return job

    def cancel(self, job_id: str) -> JobRecord:
        job = self._get(job_id)
        if job.state == JobState.queued:
            done = self.store.transition(job_id, {JobState.queued}, state=JobState.cancelled,
                                         finished_at=utcnow(), reason="cancelled while queued")
            if done is not None:
                return done
            job = self._get(job_id)
        if job.state != JobState.running:
            raise JobError(409, f"job {job_id} is {job.state.value}; only queued or running "
                                "jobs can be cancelled")
        self.store.update(job_id, reason="cancel requested")  # before the stop: what ends
        try:                                                   # next reads it as a cancel
            self._request_stop(job)
        except JobError:
            self.store.update(job_id, reason=job.reason)
            raise
        return self._get(job_id)

    def resume(self, job_id: str) -> JobRecord:
        job = self._get(job_id)
        done = self.store.transition(
            job_id, {JobState.failed, JobState.cancelled}, state=JobState.queued, resume=1,
            exit_code=None, finished_at=None, reason=None, pid=None, pid_start=None,
            executor=None,
        )
        if done is None:
            raise JobError(409, f"job {job_id} is {job.state.value}; only failed or cancelled "
                                "jobs can be resumed")
        return done

    def get(self, job_id: str) -> JobRecord:
        return self._get(job_id)

    def list(self, state: JobState | None = None, limit: int = 100) -> list[JobRecord]:
        return self.store.list(state, limit)

    def logs(self, job_id: str, tail: int = 100) -> list[str]:
        path = self._get(job_id).log_path
        if not path.exists():
            return []
        with open(path, "rb") as f:  # read only the end of big logs
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return lines[-tail:] if tail > 0 else []

    def metrics(self, job_id: str, max_points: int = 500) -> dict[str, Any]:
        """The job's metric series from its progress log (see :mod:`serving.jobs.metrics`)."""
        return read_series(self._get(job_id).log_path, max_points)

    # --- executor hooks (this class: local processes; serving.jobs.ray_jobs: a Ray cluster) ---
    def _admit(self, recipe: str, overrides: dict[str, Any], nprocs: int) -> None:
        """Last check before a valid job is queued (raise ``JobError`` to refuse it)."""

    def _request_stop(self, job: JobRecord) -> None:
        """Ask a running job to stop: SIGTERM, so that it checkpoints (SIGKILL after the grace)."""
        with self._lock:
            t = self._tracked.get(job.id)
            if t is not None and t.cancel_at is None:
                self._signal(t.pid, signal.SIGTERM)
                t.cancel_at = time.monotonic()

    # --- scheduler ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep the scheduler alive whatever happens
                log.exception("job scheduler tick failed")
            self._stop.wait(self.settings.jobs_poll_s)

    def tick(self) -> None:
        """One scheduling pass: reap finished jobs, read progress, start queued jobs."""
        with self._lock:
            for job_id in list(self._tracked):
                self._poll(job_id)
            while len(self._tracked) < self.concurrency:
                job = self.store.oldest_queued()
                if job is None or not self._launch(job):
                    break

    def _launch(self, job: JobRecord) -> bool:
        claimed = self.store.transition(job.id, {JobState.queued}, state=JobState.running,
                                        started_at=utcnow(), attempts=job.attempts + 1)
        if claimed is None:
            return True  # cancelled meanwhile; try the next one
        run_dir = Path(job.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command(claimed)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "MLFLOW_TRACKING_URI": self.settings.resolved_tracking_uri,
               "VIT_SERVICE_HOME": str(self.settings.home.resolve()),
               "VIT_SERVICE_DATA_DIR": str(self.settings.data_dir.resolve())}
        try:
            with open(claimed.log_path, "ab") as logf:
                logf.write(f"# {' '.join(cmd)}\n".encode())
                logf.flush()
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=run_dir,
                                        start_new_session=True)
        except OSError as e:
            self.store.update(job.id, state=JobState.failed, finished_at=utcnow(),
                              reason=f"could not start: {e}")
            return True
        start = _proc_start(proc.pid)
        # progress is read from here on; an earlier attempt's lines (before resuming) are skipped
        offset = claimed.log_path.stat().st_size
        self._tracked[job.id] = _Tracked(proc, proc.pid, start, offset=offset)
        self.store.update(job.id, pid=proc.pid, pid_start=start, executor="local")
        log.info("job %s started (pid %d): %s", job.id, proc.pid, " ".join(cmd))
        return True

    def command(self, job: JobRecord) -> list[str]:
        if job.resume and (Path(job.run_dir) / "checkpoints" / "last.pt").exists():
            resume = "auto"  # the checkpoint holds the resolved recipe
        else:  # first start, or a resume before any checkpoint was written: start afresh
            resume = None
        return train_command(job, sys.executable, resume)

    def _poll(self, job_id: str) -> None:
        t = self._tracked[job_id]
        job = self._read_progress(job_id, t)
        if t.cancel_at is None and job.reason == "cancel requested":
            self._signal(t.pid, signal.SIGTERM)  # asked through another process (a worker)
            t.cancel_at = time.monotonic()
        if t.cancel_at is not None and not t.killed and \
                time.monotonic() - t.cancel_at > self.settings.jobs_cancel_grace_s:
            log.warning("job %s ignored SIGTERM for %.0fs; killing it", job_id,
                        self.settings.jobs_cancel_grace_s)
            self._signal(t.pid, signal.SIGKILL)
            t.killed = True
        if t.proc is not None:
            code = t.proc.poll()
            if code is None:
                return
            self._read_progress(job_id, t)
            del self._tracked[job_id]
            job = self._get(job_id)
            if t.cancel_at is not None or job.reason == "cancel requested":
                state, reason = JobState.cancelled, "cancelled" + (" (killed)" if t.killed else "")
            elif code == 0:
                state, reason = JobState.succeeded, None
            else:
                state, reason = JobState.failed, f"exited with code {code}"
            self.store.update(job_id, state=state, exit_code=code, finished_at=utcnow(),
                              reason=reason, pid=None)
            log.info("job %s %s (exit %s)", job_id, state.value, code)
        elif not _alive(t.pid, t.pid_start):
            self._read_progress(job_id, t)
            del self._tracked[job_id]
            self._finish_adopted(self._get(job_id), "the process ended while not our child")

    def _finish_adopted(self, job: JobRecord, why: str) -> None:
        """Settle a job whose exit status we cannot know, from what its log says."""
        end = self._last_event(job, "end")
        if job.reason == "cancel requested":
            state, reason = JobState.cancelled, "cancelled"
        elif end is not None and end.get("status") in SUCCESS_STATUSES:
            state, reason = JobState.succeeded, None
        else:
            state = JobState.failed
            reason = f"{why}; exit status unknown. Resume it from its last checkpoint with " \
                     f"POST /v1/jobs/{job.id}/resume"
        self.store.update(job.id, state=state, finished_at=utcnow(), reason=reason, pid=None)
        log.info("job %s settled as %s: %s", job.id, state.value, reason)

    # --- progress -------------------------------------------------------------------------------
    def _read_progress(self, job_id: str, t: _Tracked) -> JobRecord:
        """Merge the log's new events into the job's progress; the job as read before that
        (its state and reason are the ones the merge leaves unchanged)."""
        job = self._get(job_id)
        try:
            with open(job.log_path, "rb") as f:
                f.seek(t.offset)
                data = f.read()
        except OSError:
            return job
        cut = data.rfind(b"\n") + 1  # only whole lines
        t.offset += cut
        changed = False
        progress = dict(job.progress)
        run_id = job.mlflow_run_id
        for line in data[:cut].decode("utf-8", "replace").splitlines():
            event = _parse_event(line)
            if event is None:
                continue
            changed = True
            run_id = event.get("mlflow_run_id") or run_id
            _merge_progress(progress, event)
        if changed:
            self.store.update(job_id, progress=progress, mlflow_run_id=run_id)
        return job

    def _last_event(self, job: JobRecord, kind: str) -> dict[str, Any] | None:
        for line in reversed(self.logs(job.id, tail=200)):
            event = _parse_event(line)
            if event is not None and event.get("event") == kind:
                return event
        return None

    # --- helpers --------------------------------------------------------------------------------
    def _get(self, job_id: str) -> JobRecord:
        job = self.store.get(job_id)
        if job is None:
            raise JobError(404, f"no job {job_id!r}")
        return job

    def _check_paths(self, overrides: dict[str, Any]) -> None:
        """Values of path-like keys must stay inside the configured data and home roots."""
        roots = [self.settings.data_dir.resolve(), self.settings.home.resolve()]
        for key, value in overrides.items():
            if not key.lower().rsplit(".", 1)[-1].endswith(PATH_KEY_SUFFIXES):
                continue
            if not isinstance(value, str):
                raise JobError(422, f"override {key!r} must be a path string")
            p = Path(value)
            p = (roots[0] / p if not p.is_absolute() else p).resolve()
            if not any(p == r or r in p.parents for r in roots):
                raise JobError(422, f"override {key!r}: {value!r} is outside the allowed roots "
                                    f"({', '.join(map(str, roots))})")

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)  # the whole group: torchrun and its workers
        except ProcessLookupError:
            pass


def create_job_manager(settings: Settings) -> JobManager:
    """The manager for ``settings.jobs_executor``: local processes, or a Ray cluster."""
    if settings.jobs_executor == "ray":
        from serving.jobs.ray_jobs import RayJobManager

        return RayJobManager(settings)
    return JobManager(settings)


def train_command(job: JobRecord, python: str, resume: str | None) -> list[str]:
    """The ``vit-service train`` command line of ``job``: built from its validated recipe name
    and typed overrides only (never a user string), under torchrun when it asks >1 process.
    ``resume``: None (start afresh), ``auto`` (the run's checkpoint: the recipe comes from it)
    or ``if-exists`` (the checkpoint if there is one, else afresh with the overrides)."""
    train = ["-m", "vit_service.cli", "train", job.recipe, "--run-name", f"job-{job.id}"]
    if resume is not None:
        train += ["--resume", resume]
    if resume != "auto":
        for key, value in job.overrides.items():
            train += ["--set", f"{key}={json.dumps(value)}"]  # JSON scalars parse as YAML
    if job.nprocs > 1:
        return [python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={job.nprocs}", *train]
    return [python, *train]


# Run by the job's interpreter before the trainer (standard library only: it must run where
# nothing else imports): one JSON event and exit code 78 (EX_CONFIG) when the node's
# interpreter lacks what a training job imports.
PREFLIGHT = (
    "import importlib.util as u, json, socket, sys\n"
    "missing = [m for m in ('torch', 'vit_service', 'training') if u.find_spec(m) is None]\n"
    "if missing:\n"
    "    print(json.dumps({'event': 'preflight', 'status': 'failed', 'reason': "
    "f'{sys.executable} on {socket.gethostname()} cannot import {\", \".join(missing)}: set "
    "VIT_SERVICE_RAY_PYTHON to the interpreter of the nodes that has vit-service installed'}),"
    " flush=True)\n"
    "    sys.exit(78)\n"
)


def preflight_command(python: str) -> list[str]:
    """The pre-flight check of a node's interpreter (:data:`PREFLIGHT`) as a command line."""
    return [python, "-c", PREFLIGHT]


def _parse_event(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def _merge_progress(progress: dict[str, Any], event: dict[str, Any]) -> None:
    kind = event.get("event")
    progress["last_event"] = kind
    for k in ("epoch", "epochs", "step", "total_steps"):
        if k in event:
            progress[k] = event[k]
    metrics = progress.setdefault("metrics", {})
    for k, v in event.items():
        if k in ("event", "epoch", "epochs", "step", "total_steps", "mlflow_run_id", "time"):
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            metrics[k] = v
    if kind == "end" and "status" in event:
        progress["status"] = event["status"]
    if kind == "preflight" and event.get("reason"):
        progress["preflight"] = str(event["reason"])
