"""The job scheduler: validates requests, runs each job as its own ``vit-service train`` process,
follows its JSON-lines progress, cancels it, and recovers after a server restart.

Jobs run in their own session (process group) with output to ``<run_dir>/job.log``, so they
survive a restart of the API server: on start-up the manager re-adopts live processes (checked by
pid *and* process start time), and marks jobs whose process is gone as failed, with the reason.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import signal
import socket
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
# recipe fields that name a file or folder on the server, whatever their key's suffix says
PATH_KEYS = ("data.path", "init.from", "init.timm_file")
# init.from may also name a run or a registered model: not a path then
NOT_A_PATH = ("models:/", "runs:/")
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
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


def _host_id() -> str:
    """This machine in the job store: its hostname and boot id (a rebooted host is another
    host: none of its earlier processes survived)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "0"
    return f"{socket.gethostname()}/{boot}"


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
        self.host = settings.jobs_host_id or _host_id()
        self._renewed = -math.inf  # monotonic time of the last lease renewal

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
            if job.host not in (None, self.host):  # another API host's job
                self._settle_if_expired(job)
                continue
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
        overrides = self._check_paths(overrides)
        self._check_caps(overrides)
        self.validate(recipe, overrides)
        if self.validate is _default_validate:  # a real recipe: its model can be counted
            self._check_model_size(recipe, overrides)
        self._check_queue()
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
        # check-and-set before the stop (what ends next reads it as a cancel): a job that
        # finished meanwhile keeps its own state and reason
        if self.store.transition(job_id, {JobState.running}, reason="cancel requested") is None:
            job = self._get(job_id)
            raise JobError(409, f"job {job_id} is {job.state.value}; only queued or running "
                                "jobs can be cancelled")
        try:
            self._request_stop(job)
        except JobError:
            self.store.transition(job_id, {JobState.running}, reason=job.reason)
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
        """One scheduling pass: reap finished jobs, read progress, renew this host's leases
        and settle expired ones of other hosts, start queued jobs."""
        with self._lock:
            for job_id in list(self._tracked):
                self._poll(job_id)
            if time.monotonic() - self._renewed >= self.settings.jobs_lease_s / 3:
                self._renewed = time.monotonic()
                self.store.heartbeat(list(self._tracked), self.host)
                for job in self.store.list(JobState.running, limit=10_000):
                    if job.host not in (None, self.host) and job.id not in self._tracked:
                        self._settle_if_expired(job)
            while len(self._tracked) < self.concurrency:
                job = self.store.oldest_queued()
                if job is None or not self._launch(job):
                    break

    def _launch(self, job: JobRecord) -> bool:
        claimed = self.store.transition(job.id, {JobState.queued}, state=JobState.running,
                                        started_at=utcnow(), attempts=job.attempts + 1,
                                        host=self.host, heartbeat_at=utcnow())
        if claimed is None:
            return True  # cancelled meanwhile; try the next one
        # from the claim on, the job either starts or is failed with the reason: nothing may
        # leave it marked running with no process (a full disk, a folder in the way)
        try:
            run_dir = Path(job.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = self.command(claimed)
            env = {**os.environ, "PYTHONUNBUFFERED": "1",
                   "MLFLOW_TRACKING_URI": self.settings.resolved_tracking_uri,
                   "VIT_SERVICE_HOME": str(self.settings.home.resolve()),
                   "VIT_SERVICE_DATA_DIR": str(self.settings.data_dir.resolve())}
            with open(claimed.log_path, "ab") as logf:
                logf.write(f"# {' '.join(cmd)}\n".encode())
                logf.flush()
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=run_dir,
                                        start_new_session=True)
        except Exception as e:  # noqa: BLE001 (whatever it was, the job must not hang)
            log.exception("job %s could not start", job.id)
            self.store.transition(job.id, {JobState.running}, state=JobState.failed,
                                  finished_at=utcnow(),
                                  reason=f"could not start: {type(e).__name__}: {e}")
            return True
        start = _proc_start(proc.pid)
        # progress is read from here on; an earlier attempt's lines (before resuming) are skipped
        offset = claimed.log_path.stat().st_size
        self._tracked[job.id] = _Tracked(proc, proc.pid, start, offset=offset)
        self.store.update(job.id, pid=proc.pid, pid_start=start, executor="local",
                          host=self.host, heartbeat_at=utcnow())
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

    def _settle_if_expired(self, job: JobRecord) -> None:
        """Another host's running job: left alone while that host renews its lease (its
        process is not ours to check: pids mean nothing across hosts); settled from its log
        once the lease has expired (the host died, or lost the database)."""
        beat = job.heartbeat_at or job.started_at
        if beat is not None and (utcnow() - beat).total_seconds() < self.settings.jobs_lease_s:
            return
        if job.executor not in (None, "local"):
            return  # a Ray job: its own executor follows it
        self._read_progress(job.id, _Tracked(None, 0, None))
        self._finish_adopted(self._get(job.id), f"its API host {job.host} stopped renewing its "
                                                "lease")

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
        if self.store.transition(job.id, {JobState.running}, state=state, finished_at=utcnow(),
                                 reason=reason, pid=None) is not None:
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

    def _check_paths(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Every path the overrides name (the recipe's path fields, and any key that looks like
        one, nested or dotted) must stay inside the data or home roots once resolved: ``~`` is
        refused (the trainer would expand it), a relative path is the data folder's, and
        symlinks are followed. Returns the overrides with each such path replaced by its
        resolved absolute form, which is what the trainer gets."""
        roots = [self.settings.data_dir.resolve(), self.settings.home.resolve()]
        out = copy.deepcopy(overrides)
        for key, value in _flatten(overrides).items():
            k = key.lower()
            if k not in PATH_KEYS and not k.rsplit(".", 1)[-1].endswith(PATH_KEY_SUFFIXES):
                continue
            if value is None:
                continue
            if not isinstance(value, str) or not value or "\x00" in value:
                raise JobError(422, f"override {key!r} must be a path string")
            if value.startswith("~"):
                raise JobError(422, f"override {key!r}: ~ is not expanded here; give a path "
                                    "relative to the data folder")
            if k == "init.from" and (value.startswith(NOT_A_PATH) or RUN_ID.match(value)):
                continue
            if "://" in value:
                raise JobError(422, f"override {key!r}: URLs are not accepted here")
            p = Path(value)
            p = (roots[0] / p if not p.is_absolute() else p).resolve()
            if not any(p == r or r in p.parents for r in roots):
                raise JobError(422, f"override {key!r}: {value!r} is outside the data and home "
                                    "folders")
            _set(out, key, str(p))
        return out

    def _check_caps(self, overrides: dict[str, Any]) -> None:
        """Sizes a job may ask for through the API (settings ``jobs_max_*``): 422 past them
        (``nprocs`` is capped by :meth:`submit` itself)."""
        s = self.settings
        flat_caps = _flatten(overrides)
        caps = {"epochs": s.jobs_max_epochs, "batch_size": s.jobs_max_batch_size,
                "eval_batch_size": s.jobs_max_batch_size, "threads": s.jobs_max_threads,
                "processes": s.jobs_max_procs}
        for key, cap in caps.items():
            value = flat_caps.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
                raise JobError(422, f"override {key!r}: {value} is over this server's limit of "
                                    f"{cap}")
        budget = flat_caps.get("budget_minutes")
        if isinstance(budget, (int, float)) and budget > s.jobs_max_budget_minutes:
            raise JobError(422, f"override 'budget_minutes': {budget} is over this server's "
                                f"limit of {s.jobs_max_budget_minutes}")

    def _check_model_size(self, recipe: str, overrides: dict[str, Any]) -> None:
        """The model the job would build, estimated from its config (nothing is built):
        422 past ``jobs_max_params``, whatever combination of overrides got it there."""
        from training.recipes import load_recipe
        from vit_service.models import get_config

        r = load_recipe(recipe, overrides)
        fields: dict[str, Any] = {}
        if r.task == "text":  # the tokenizer's real size is known after training it
            fields = {"vocab_size": r.data.vocab_size or 32_000, "max_len": r.data.max_len or 512}
        try:
            cfg = get_config(r.model.name, pos_encoding=r.model.pos_encoding, num_classes=1000,
                             **fields, **r.model.overrides)
        except (KeyError, TypeError, ValueError) as e:
            raise JobError(422, f"model.overrides: {e}") from e
        n = estimate_parameters(cfg)
        if n > self.settings.jobs_max_params:
            raise JobError(422, f"the model would have {n / 1e6:.0f}M parameters; this server "
                                f"takes at most {self.settings.jobs_max_params / 1e6:.0f}M")

    def _check_queue(self) -> None:
        """429 when the queue already holds ``jobs_max_queued`` jobs."""
        queued = len(self.store.list(JobState.queued, limit=self.settings.jobs_max_queued + 1))
        if queued >= self.settings.jobs_max_queued:
            raise JobError(429, f"the job queue is full ({queued} queued, the limit is "
                                f"{self.settings.jobs_max_queued}); retry when one has started")

    @staticmethod
    def _signal(pid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)  # the whole group: torchrun and its workers
        except ProcessLookupError:
            pass


def estimate_parameters(cfg: Any) -> int:
    """An upper-bound estimate of a ViT's or text encoder's parameters from its config alone
    (nothing is built: the point is to refuse a job before it allocates): the blocks, the
    token and position tables, the patch stem and the head."""
    d = int(cfg.embed_dim)
    hidden = int(d * float(getattr(cfg, "mlp_ratio", 4.0)))
    block = 4 * d * d + 2 * d * hidden + 10 * d + hidden  # qkv + proj, MLP, norms, biases
    n = int(cfg.depth) * block
    n += int(getattr(cfg, "vocab_size", 0)) * d + int(getattr(cfg, "max_len", 0)) * d
    buckets, width = int(getattr(cfg, "bigram_buckets", 0)), int(getattr(cfg, "bigram_dim", 0))
    n += buckets * (width or d) + (width * d if width else 0)
    patch = int(getattr(cfg, "patch_size", 0))
    n += int(getattr(cfg, "in_chans", 0)) * patch * patch * d
    if getattr(cfg, "img_size", 0) and patch:
        n += (int(cfg.img_size) // patch) ** 2 * d
    stem = int(getattr(cfg, "stem_width", 0)) if getattr(cfg, "stem", "") == "conv" else 0
    n += 9 * (3 * stem + 2 * stem * stem + 8 * stem * stem) + 4 * stem * d
    return n + d * int(getattr(cfg, "num_classes", 0))


def _flatten(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"data": {"path": x}}`` -> ``{"data.path": x}`` (dotted keys kept as they are)."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{full}."))
        else:
            out[full] = value
    return out


def _set(overrides: dict[str, Any], dotted: str, value: Any) -> None:
    """Set the value :func:`_flatten` found at ``dotted``, dotted or nested."""
    if dotted in overrides:
        overrides[dotted] = value
        return
    for k in [k for k in overrides if dotted.startswith(f"{k}.")]:
        if isinstance(overrides[k], dict):
            _set(overrides[k], dotted[len(k) + 1:], value)
            return


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
