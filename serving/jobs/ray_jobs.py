"""Training jobs on a Ray cluster, behind the same jobs API (``VIT_SERVICE_JOBS_EXECUTOR=ray``):
the :class:`RayExecutor` the job manager launches through.

The SQL job table stays the source of truth; Ray runs the processes. Each attempt is one Ray job
submitted through ``ray.job_submission.JobSubmissionClient`` with ``submission_id`` = our job id
(``<id>-r<n>`` for the n-th attempt after a resume: Ray ids are single-use) and, as entrypoint,
the same validated ``vit-service train RECIPE --set ...`` command line the local executor runs
(built from the recipe name and typed overrides, shell-quoted; never a user string). A job that
asks several processes (``nprocs``) runs a Ray Train driver instead (:mod:`training.ray_train`):
``nprocs`` workers that may land on different nodes, checkpoints in Ray's storage
(``ray_storage_path``), restarted from the last one when a worker or node dies
(``ray_max_failures``). Resources come from the recipe: a GPU per process for ``device: cuda``
(and for ``auto`` when ``ray_auto_gpus``), ``ray_cpus_per_proc`` CPUs per process. The
``runtime_env`` carries environment variables only (tracking URI, home, data folder, the stop
grace): the nodes run the trainer image, which has the package installed, so no code is
uploaded.

Every scheduler pass polls every running job of the table with Ray, whichever API process
started it (two API replicas on one database see the same cluster):

- ``PENDING`` / ``RUNNING``: running (the reason says when Ray is still waiting for resources);
- ``SUCCEEDED``: succeeded; ``STOPPED``: cancelled (after our cancel) or failed (stopped by
  someone else); ``FAILED``: failed with Ray's message;
- no such job on the cluster: failed, "the Ray cluster has no record of this job" (a head
  restarted without GCS fault tolerance forgets its jobs), resumable from its last checkpoint;
- Ray unreachable: nothing changes, the pass is retried; submissions get a 503.

Logs come through Ray (``get_job_logs``): each pass appends what is new to the job's ``job.log``
under the API's own home, so logs, progress and metric series are read exactly as for a local
job, and the API needs no disk shared with the nodes. Cancel is ``stop_job``: Ray sends SIGTERM,
the trainer checkpoints (a Ray Train driver passes the stop on to its workers), and SIGKILL
follows after ``jobs_cancel_grace_s`` (``RAY_JOB_STOP_WAIT_TIME_S`` in the job's environment).
A resume submits the next attempt: one process with ``--resume if-exists`` (the trainer finds
the checkpoint under the shared ``ray_home`` on whichever node runs it); a Ray Train job with
the same run name and storage, from which Ray hands its workers the latest checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shlex
import time
from collections.abc import Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

from serving.jobs.admission import Capacity, Node, Shape
from serving.jobs.commands import preflight_command, ray_train_command, train_command
from serving.jobs.executor import (
    CANCEL_REQUESTED,
    Ended,
    ExecutorUnavailable,
    LaunchFailed,
    NeverStarted,
    Poll,
    Running,
)
from serving.jobs.model import Job, JobState
from serving.jobs.progress import parse_event
from serving.jobs.store import utcnow
from training.progress import Event
from vit_service.config import Settings

log = logging.getLogger(__name__)

LOST = ("the Ray cluster has no record of this job (its head restarted without GCS fault "
        "tolerance, or the job was deleted there); resume it from its last checkpoint with "
        "POST /v1/jobs/{id}/resume")
PENDING_REASON = "waiting for resources on the Ray cluster"


class RayUnavailable(ExecutorUnavailable):
    def __init__(self, address: str, err: Exception) -> None:
        super().__init__(503, f"the Ray cluster at {address} is unreachable ({err}); "
                              "nothing was submitted, try again when it is back")


def _client_class() -> type:
    from ray.job_submission import JobSubmissionClient

    class _Client(JobSubmissionClient):
        """The SDK's client with a timeout on every request: a head that stopped answering
        must not freeze the scheduler or an API request (the SDK sets none)."""

        timeout_s: float = 10.0

        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", self.timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return _Client


def submission_id(job: Job) -> str:
    """The Ray submission id of the job's current attempt: the job id, then ``<id>-r<n>`` for
    the n-th attempt (Ray ids are single-use, and an old attempt's record stays on the
    cluster, with its logs)."""
    return job.id if job.attempts <= 1 else f"{job.id}-r{job.attempts}"


def _preflight_reason(log_text: str) -> str | None:
    """The reason of the latest failed pre-flight check in an attempt's log, if any."""
    reason = None
    for line in log_text.splitlines():
        event = parse_event(line)
        if event is not None and event["event"] == Event.preflight and event.get("reason"):
            reason = str(event["reason"])
    return reason


def _not_found(err: Exception) -> bool:
    return isinstance(err, RuntimeError) and "status code 404" in str(err)


class RayExecutor:
    """Attempts as Ray jobs (module docstring)."""

    name = "ray"
    host_bound = False

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.address = settings.ray_address
        # Ray queues what the cluster cannot place yet; this bounds what we hand it at once
        self.concurrency = settings.jobs_concurrency or 16
        self._client: Any = None
        self._unreachable_since: float | None = None

    # --- the Ray client -------------------------------------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            cls = _client_class()
            cls.timeout_s = self.settings.ray_timeout_s
            try:
                self._client = cls(self.address)
            except (OSError, RuntimeError) as e:  # ConnectionError: nothing answers there
                raise RayUnavailable(self.address, e) from e
        return self._client

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``client.<name>(...)``; network failures become :class:`RayUnavailable`."""
        try:
            out = getattr(self.client(), name)(*args, **kwargs)
        except OSError as e:  # requests' ConnectionError / Timeout are OSErrors
            self._client = None
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
                log.warning("Ray at %s unreachable: %s", self.address, e)
            raise RayUnavailable(self.address, e) from e
        if self._unreachable_since is not None:
            log.info("Ray at %s reachable again after %.0fs", self.address,
                     time.monotonic() - self._unreachable_since)
            self._unreachable_since = None
        return out

    # --- the executor -------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._call("get_version")
        except RayUnavailable as e:  # start anyway: the scheduler retries every pass
            log.warning("%s", e.detail)

    def check(self) -> None:
        self._call("get_version")  # 503 now rather than a job that cannot start

    def forget(self, keep: Collection[str] = ()) -> None:
        pass  # nothing held: every pass asks Ray about every running job

    def followed_elsewhere(self, job: Job) -> bool:
        return False  # every leader follows every running Ray job

    def adopt(self, job: Job) -> bool:
        return True  # nothing to adopt by pid: every pass polls every running job with Ray

    def following(self, running: list[Job]) -> list[str]:
        # a job started by a local-executor API process is not ours to settle
        return [job.id for job in running if job.executor != "local"]

    def launch(self, job: Job) -> dict[str, Any]:
        cmd = self.command(job)
        # the pre-flight check first: a node whose interpreter cannot import the project fails
        # the job with a reason that says so, not with a traceback from deep in an import
        entrypoint = f"{shlex.join(preflight_command(cmd[0]))} && {shlex.join(cmd)}"
        sid = submission_id(job)
        try:
            self._call("submit_job", entrypoint=entrypoint, submission_id=sid,
                       runtime_env=self.runtime_env(), **self.resources(job),
                       metadata={"vit_service_job": job.id, "recipe": job.recipe})
        except (RuntimeError, ValueError) as e:
            if "already exists" not in str(e):
                raise LaunchFailed(f"Ray refused the submission: {e}") from e
            # submitted by us before a crash: it is on Ray
            log.warning("job %s was already on Ray; following it", job.id)
        run_dir = Path(job.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(job.log_path, "ab") as f:
            f.write(f"# ray job {sid} at {self.address}: {entrypoint}\n".encode())
        self._mirror_state(job, reset=True)
        log.info("job %s submitted to Ray at %s as %s: %s", job.id, self.address, sid,
                 entrypoint)
        return {"executor": self.name, "reason": PENDING_REASON}

    def command(self, job: Job) -> list[str]:
        """One process: ``vit-service train`` (the trainer checks the shared run folder for a
        checkpoint itself: the API cannot see the nodes' disks). Several: a Ray Train driver
        whose workers may land on different nodes (:mod:`training.ray_train`); a resumed job
        reuses the run name and storage, so Ray hands its workers the latest checkpoint."""
        python = self.settings.resolved_ray_python
        if job.nprocs <= 1:
            return train_command(job, python, "if-exists" if job.resume else None)
        return ray_train_command(job, python, storage=self.storage_path(),
                                 **self.worker_resources(job),
                                 max_failures=self.settings.ray_max_failures,
                                 placement=self.settings.ray_placement)

    def storage_path(self) -> str:
        """Ray Train's ``storage_path``: where multi-worker jobs' checkpoints go."""
        s = self.settings
        return s.ray_storage_path or f"{s.ray_home or s.home.resolve()}/ray-train"

    def worker_resources(self, job: Job) -> dict[str, float]:
        """What each process of the job asks: ``ray_cpus_per_proc`` CPUs, and a GPU for a
        ``device: cuda`` recipe (and ``auto`` with ``ray_auto_gpus``)."""
        from training.recipes import load_recipe, setting_texts

        device = load_recipe(job.recipe, setting_texts(job.overrides)).device
        gpus = device == "cuda" or (device == "auto" and self.settings.ray_auto_gpus)
        return {"cpus_per_worker": self.settings.ray_cpus_per_proc,
                "gpus_per_worker": 1.0 if gpus else 0.0}

    def runtime_env(self) -> dict[str, Any]:
        s = self.settings
        env = {
            "PYTHONUNBUFFERED": "1",
            "MLFLOW_TRACKING_URI": s.ray_tracking_uri or s.resolved_tracking_uri,
            "VIT_SERVICE_HOME": s.ray_home or str(s.home.resolve()),
            "VIT_SERVICE_DATA_DIR": s.ray_data_dir or str(s.data_dir.resolve()),
            "RAY_JOB_STOP_WAIT_TIME_S": str(max(1, round(s.jobs_cancel_grace_s))),
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
            # every worker's progress lines reach the job log: Ray's log deduplication would
            # keep one of N lines that differ only in numbers (each rank's "ready", say)
            "RAY_DEDUP_LOGS": "0",
            # multi-worker jobs rely on Train v2 (a resumed job's driver gets the run's latest
            # checkpoint from the storage by its name); on by default in the tested Ray 2.60
            "RAY_TRAIN_V2_ENABLED": "1",
        }
        if s.cache_dir is not None:
            env["VIT_SERVICE_CACHE_DIR"] = str(s.cache_dir.resolve())
        return {"env_vars": env}

    def resources(self, job: Job) -> dict[str, float]:
        """What the entrypoint reserves: the whole job for one process; nothing for a Ray
        Train driver (it only coordinates: its workers reserve their own, on any node)."""
        if job.nprocs > 1:
            return {"entrypoint_num_cpus": 0.0}
        per = self.worker_resources(job)
        out = {"entrypoint_num_cpus": per["cpus_per_worker"]}
        if per["gpus_per_worker"]:
            out["entrypoint_num_gpus"] = per["gpus_per_worker"]
        return out

    def poll(self, job: Job) -> Poll:
        if job.executor is None:  # claimed; submitted by now, unless its claimer died first
            if job.started_at and utcnow() - job.started_at < timedelta(
                    seconds=self.settings.ray_submit_grace_s):
                return Running()
        try:
            info = self._call("get_job_info", submission_id(job))
        except RuntimeError as e:
            if not _not_found(e):
                raise
            if job.executor is None:  # never reached Ray: queue it again
                log.warning("job %s was claimed but never submitted; queued again", job.id)
                return NeverStarted()
            log.warning("job %s: %s", job.id, LOST.format(id=job.id))
            return Ended(JobState.failed, LOST.format(id=job.id))  # its mirror: all there is
        fields: dict[str, Any] = {"executor": self.name} if job.executor is None else {}
        text = self._mirror_logs(job)
        status = str(getattr(info.status, "value", info.status))
        if status in ("PENDING", "RUNNING"):
            want = PENDING_REASON if status == "PENDING" else None
            if job.reason in (None, PENDING_REASON) and job.reason != want:
                fields["reason"] = want
            return Running(fields)
        if status not in ("SUCCEEDED", "STOPPED", "FAILED"):
            return Running(fields)  # a newer state this code does not know: leave it running
        code = getattr(info, "driver_exit_code", None)
        if status == "SUCCEEDED":
            state, reason, code = JobState.succeeded, None, 0 if code is None else code
        elif status == "STOPPED" and job.reason == CANCEL_REQUESTED:
            state, reason = JobState.cancelled, "cancelled"
        elif status == "STOPPED":
            state, reason = JobState.failed, (f"stopped on the Ray cluster, not through this "
                                              f"service; resume it with POST /v1/jobs/{job.id}"
                                              "/resume")
        else:  # a failed pre-flight check says what the node lacks (the latest one reported)
            preflight = _preflight_reason(text) or job.progress.get("preflight")
            state, reason = JobState.failed, (f"pre-flight failed on the node: {preflight}"
                                              if preflight else f"failed on Ray: {info.message}")
        log.info("job %s %s on Ray (%s)", job.id, state.value, info.message)
        return Ended(state, reason, code, fields)

    def stop(self, job: Job) -> None:
        try:
            self._call("stop_job", submission_id(job))
        except RuntimeError as e:  # not found or already finished: the next pass settles it
            log.info("stop_job %s: %s", job.id, e)

    # --- logs, mirrored from Ray into job.log --------------------------------------------------
    def _mirror_state(self, job: Job, reset: bool = False) -> dict[str, Any]:
        path = Path(job.run_dir) / "ray-mirror.json"
        state = {"attempt": job.attempts, "bytes": 0}
        if not reset:
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        if reset or state.get("attempt") != job.attempts:
            state = {"attempt": job.attempts, "bytes": 0}
            path.write_text(json.dumps(state))
        return state

    def _mirror_logs(self, job: Job) -> str:
        """Append what Ray has of this attempt's log beyond what the mirror holds; the log."""
        text = self._call("get_job_logs", submission_id(job))
        data = text.encode("utf-8", "replace")
        run_dir = Path(job.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "ray-mirror.lock", "w") as lock:  # two API processes, one home
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._mirror_state(job)
            have = int(state.get("bytes", 0))
            if len(data) > have:
                with open(job.log_path, "ab") as f:
                    f.write(data[have:])
                state["bytes"] = len(data)
                (run_dir / "ray-mirror.json").write_text(json.dumps(state))
        return text

    # --- admission: what a job needs, what the cluster has free ------------------------------
    _no_report_logged = False  # said once that the head publishes no resource report

    def needs(self, job: Job) -> dict[str, float]:
        """What the job holds on Ray while it runs, as admission counts it: each process's
        CPUs and GPUs (:meth:`worker_resources`) times ``nprocs``: the entrypoint's for one
        process, the Ray Train workers' for several (their driver reserves nothing)."""
        per = self.worker_resources(job)  # one process, or each Ray Train worker
        return {"CPU": per["cpus_per_worker"] * job.nprocs,
                "GPU": per["gpus_per_worker"] * job.nprocs}

    def placement(self, job: Job) -> Shape:
        """One process: on one node. A Ray Train job's workers: each on any node with room
        (``ray_placement`` PACK, SPREAD), one per node (STRICT_SPREAD), or all on one
        (STRICT_PACK)."""
        how = self.settings.ray_placement
        if job.nprocs <= 1 or how == "STRICT_PACK":
            return Shape()
        return Shape(job.nprocs, 1 if how == "STRICT_SPREAD" else None)

    def capacity(self) -> Capacity | None:
        """Each node's CPUs and GPUs, in all and in use, from the head's dashboard over HTTP
        (``GET /api/cluster_status``: the autoscaler monitor's load report, refreshed every
        second or so; what ``ray status`` prints). None when the head publishes no report
        (autoscaler v2 writes none): jobs are then admitted by slots and Ray queues the rest.
        An empty report (a head just started) is a cluster with nothing free yet."""
        resp = self._call("_do_request", "GET", "/api/cluster_status")
        try:
            resp.raise_for_status()
            status = (resp.json().get("data") or {}).get("clusterStatus")
            usage = status["loadMetricsReport"]["usageByNode"] if status else None
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.warning("the Ray head at %s gave no resource report (%s): jobs are admitted "
                        "by slots alone", self.address, e)
            return None
        if usage is None:
            if not self._no_report_logged:
                log.warning("the Ray head at %s publishes no resource report (autoscaler v2?): "
                            "jobs are admitted by slots alone, Ray queues what does not fit",
                            self.address)
                self._no_report_logged = True
            return None
        nodes = []
        for per_node in usage.values():  # resource -> [used, total]
            total = {r: float(per_node.get(r, (0.0, 0.0))[1]) for r in ("CPU", "GPU")}
            used = {r: float(per_node.get(r, (0.0, 0.0))[0]) for r in ("CPU", "GPU")}
            nodes.append(Node(total, {r: total[r] - used[r] for r in total}))
        return Capacity(nodes, cluster="the Ray cluster", elastic=True)
