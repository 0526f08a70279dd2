"""The job scheduler: validates requests, queues them, launches each job through an
:class:`~serving.jobs.executor.Executor` (local processes or a Ray cluster), follows its
JSON-lines progress, cancels it, and recovers after a server restart.

The manager owns the queue, the checks, the store and the progress; the executor starts,
watches and stops attempts (see :mod:`serving.jobs.executor`); :mod:`serving.jobs.leases`
keeps this host's leases and settles attempts whose exit status nobody can know.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from serving.jobs import validation
from serving.jobs.admission import Plan, check_queued_caps, owner_of, plan
from serving.jobs.executor import (
    CANCEL_REQUESTED,
    Ended,
    Executor,
    ExecutorUnavailable,
    LaunchFailed,
    NeverStarted,
    Running,
    Vanished,
)
from serving.jobs.leases import Leases, host_id
from serving.jobs.local import LocalExecutor
from serving.jobs.metrics import read_series
from serving.jobs.model import Job, JobError, JobState
from serving.jobs.progress import read_progress, tail_lines
from serving.jobs.resources import ResourceView
from serving.jobs.store import JobStore, utcnow
from vit_service.config import DEFAULT_PRINCIPAL, Settings

log = logging.getLogger(__name__)


class JobManager:
    def __init__(
        self,
        settings: Settings,
        executor: Executor | None = None,
        store: JobStore | None = None,
        validate: Callable[[str, dict[str, Any]], None] = validation.validate_recipe,
    ) -> None:
        self.settings = settings
        self.executor: Executor = executor or LocalExecutor(settings)
        self.store = store or JobStore(settings.resolved_jobs_db_url)
        self.validate = validate
        self.runs_root = (settings.home / "runs").resolve()
        self.host = settings.jobs_host_id or host_id()
        self._offsets: dict[str, int] = {}  # how far each followed job's log was read
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._closed = False  # stop() was called: never lead again
        self._thread: threading.Thread | None = None
        # launch and settle (as a lone manager does, and start() again), or, after step_down(),
        # only follow this host's own attempts to their end
        self._leading = True
        # a check of the queued caps and the insert it allows, one submit at a time (in this
        # process; two API processes may still overshoot a cap by a job or so)
        self._submit_lock = threading.Lock()
        self.resources = ResourceView(self.executor)  # capacity and needs, for admission
        self.leases = Leases(self.store, self.executor, self.host, settings.jobs_lease_s,
                             self._get, self._recover_one)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Lead: schedule (launch queued jobs, settle other hosts' expired ones). Also after a
        step-down (serving/app.py), when what this process followed before may have been
        settled, or resumed elsewhere, by another leader: :meth:`recover` re-adopts from the
        table what is still ours (keeping the handles of attempts it still follows, so their
        exit codes are not lost) and the executor forgets the rest."""
        with self._lock:  # a following-only pass may be under way (after a step-down)
            if self._closed:  # a lead that was still starting when the server shut down
                log.info("job manager stopped already: not leading")
                return
            self.executor.start()
            kept = self.recover()
            self.executor.forget(keep=kept)
            self._offsets = {k: v for k, v in self._offsets.items() if k in kept}
            self._leading = True
            # a stop() that gave up waiting for the lock above may have come meanwhile
            if not self._closed and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._loop, name="job-scheduler",
                                                daemon=True)
                self._thread.start()
        log.info("job manager started: %d at once (%s), database %s",
                 self.executor.concurrency, self.executor.name,
                 self.store.engine.url.render_as_string(hide_password=True))

    def step_down(self) -> None:
        """Stop leading (another process may lead already): once this returns, this process
        launches nothing and settles no other host's job (a pass under way ends first). The
        attempts a host-bound executor started here are still followed to their end and their
        leases renewed, so a leader that loses its lock does not fail its healthy jobs; on a
        shared cluster (Ray) the new leader follows them all."""
        with self._lock:
            self._leading = False

    def stop(self) -> None:
        """Stop the scheduler thread for good (server shutdown; a :meth:`start` still under
        way, or called later, then does nothing). Running jobs keep running: they are
        re-adopted by the next server, or settled by another host once their lease expired."""
        self._closed = True
        self._stop.set()
        # a pass that hangs (a database or a Ray head that does not answer) must not hold up
        # the shutdown for longer than the join below would
        if self._lock.acquire(timeout=10):
            try:
                self._leading = False
            finally:
                self._lock.release()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def recover(self) -> set[str]:
        """Re-adopt this host's live attempts; settle the ones that are gone from their logs.
        Returns the ids adopted. (Attempts on a shared cluster need nothing: every pass polls
        them all.)"""
        adopted: set[str] = set()
        if not self.executor.host_bound:
            return adopted
        for job in self.store.list(JobState.running, limit=10_000):
            if job.host not in (None, self.host):  # another API host's job
                self.leases.settle_if_expired(job)
                continue
            if self.executor.followed_elsewhere(job) and not self.leases.expired(job):
                # a sibling process of this host started it and follows it to its end (it
                # led before); should it die, the lease runs out and the leader recovers it
                log.info("job %s is followed by the process that started it (pid %s's "
                         "parent)", job.id, job.pid)
                continue
            if self._recover_one(job, "the job's process was gone when the API server "
                                      "restarted"):
                adopted.add(job.id)
        return adopted

    def _recover_one(self, job: Job,
                     why: str = "the API process that followed it stopped") -> bool:
        """Follow one of this host's running attempts again (True), or settle it from its
        log when its process is gone (it may have finished meanwhile)."""
        if self.executor.adopt(job):
            self._offsets.setdefault(job.id, 0)  # a kept attempt reads on where it was
            return True
        read_progress(self.store, job.id, 0)
        self.leases.settle_from_log(self._get(job.id), why)
        return False

    # --- API operations -------------------------------------------------------------------------
    def submit(self, recipe: str, overrides: dict[str, Any], name: str = "",
               nprocs: int = 1, priority: int = 0, owner: str = DEFAULT_PRINCIPAL) -> Job:
        """Check a request and queue it for ``owner`` (the API key's principal): 422 for what
        could never run, 429 past a queued cap (:func:`~.admission.check_queued_caps`)."""
        for where, value in (("recipe", recipe), ("name", name), ("overrides", overrides)):
            validation.check_text(where, value)
        overrides = self._admissible(recipe, validation.typed_overrides(overrides), nprocs)
        with self._submit_lock:
            check_queued_caps(self._queued(), self.settings, owner)
            job = self.store.create(name=name, recipe=recipe, overrides=overrides,
                                    nprocs=nprocs, runs_root=self.runs_root, priority=priority,
                                    owner=owner)
        log.info("job %s queued for %s (priority %d): %s %s", job.id, owner, priority, recipe,
                 overrides)
        return self._with_queue([job])[0]

    def cancel(self, job_id: str) -> Job:
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
        if self.store.transition(job_id, {JobState.running}, reason=CANCEL_REQUESTED) is None:
            job = self._get(job_id)
            raise JobError(409, f"job {job_id} is {job.state.value}; only queued or running "
                                "jobs can be cancelled")
        try:
            self.executor.stop(job)
        except JobError:
            self.store.transition(job_id, {JobState.running}, reason=job.reason)
            raise
        return self._get(job_id)

    def resume(self, job_id: str) -> Job:
        """Queue a failed or cancelled job again, checked against the server's limits now
        (422: caps lowered since, a path now outside its folders, a machine too small; 503:
        no executor) and counted against its owner's queued caps like a new job (429)."""
        job = self._get(job_id)
        done = None
        if job.state in (JobState.failed, JobState.cancelled):
            # checked again against this server as it is now: its limits, folders and machine
            # may have changed since the job was submitted (or the row is an older release's).
            # Not the recipe: a resume from a checkpoint runs the recipe saved in it, which a
            # check of today's recipe file would misjudge (submit checked it, and a restart
            # without a checkpoint that no longer validates fails with the trainer's reason)
            self._admissible(job.recipe, job.overrides, job.nprocs, recipe_checks=False)
            with self._submit_lock:
                check_queued_caps(self._queued(), self.settings, owner_of(job))
                done = self.store.transition(
                    job_id, {JobState.failed, JobState.cancelled}, state=JobState.queued,
                    resume=1, exit_code=None, finished_at=None, reason=None, pid=None,
                    pid_start=None, executor=None,
                )
        if done is None:
            raise JobError(409, f"job {job_id} is {job.state.value}; only failed or cancelled "
                                "jobs can be resumed")
        return self._with_queue([done])[0]

    def get(self, job_id: str) -> Job:
        return self._with_queue([self._get(job_id)])[0]

    def list(self, state: JobState | None = None, limit: int = 100) -> list[Job]:
        return self._with_queue(self.store.list(state, limit))

    def logs(self, job_id: str, tail: int = 100) -> list[str]:
        return tail_lines(self._get(job_id).log_path, tail)

    def metrics(self, job_id: str, max_points: int = 500) -> dict[str, Any]:
        """The job's metric series from its progress log (see :mod:`serving.jobs.metrics`)."""
        return read_series(self._get(job_id).log_path, max_points)

    # --- scheduler ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep the scheduler alive whatever happens
                log.exception("job scheduler tick failed")
            self._stop.wait(self.settings.jobs_poll_s)

    def tick(self) -> None:
        """One scheduling pass: follow the running jobs (progress, ends), renew this host's
        leases and settle expired ones of other hosts, start the queued jobs admission lets
        start (:mod:`serving.jobs.admission`). An executor that does not answer ends the pass
        (retried on the next)."""
        with self._lock:
            try:
                if not self._leading:
                    self._follow_own()
                    return
                for job_id in self.executor.following(self._running()):
                    self._follow(job_id)
                if self.executor.host_bound:
                    self.leases.renew()
                queue = self._queue()
                if queue:
                    running = self._running()
                    # a host-bound executor's slots: the attempts this process follows and
                    # this host's others in the table (a sibling process's, one to recover)
                    busy = len(set(self.executor.following(running))
                               | {j.id for j in self._holding(running)}) \
                        if self.executor.host_bound else len(running)
                    for job in self._plan(queue, running, busy, strict=True).start:
                        self._launch(job)
            except ExecutorUnavailable:
                return  # logged by the executor

    def _follow_own(self) -> None:
        """A pass while not leading: a host-bound executor's own attempts are followed to
        their end and their leases renewed; nothing is launched or settled for another host."""
        if not self.executor.host_bound:
            return
        mine = self.executor.following(self._running())
        for job_id in mine:
            self._follow(job_id)
        if mine:
            self.leases.renew(settle_others=False)

    def _running(self) -> list[Job]:
        return self.store.list(JobState.running, limit=10_000)

    def _queued(self) -> list[Job]:
        return self.store.list(JobState.queued, limit=10_000)  # in no particular order

    def _queue(self) -> list[Job]:
        """The queued jobs in admission order (priority, then age)."""
        ids = self.store.queue_order()
        if not ids:
            return []
        found = {j.id: j for j in self.store.list(JobState.queued, limit=len(ids) + 1000)}
        return [found[i] for i in ids if i in found]

    def _holding(self, running: list[Job]) -> list[Job]:
        """The running jobs that hold this executor's slots and resources, from the table (any
        API process answers alike): a host-bound executor's jobs on this host, or every job a
        shared cluster runs (whichever API process started it)."""
        if self.executor.host_bound:
            return [j for j in running if j.host in (None, self.host)
                    and j.executor in (None, self.executor.name)]
        mine = set(self.executor.following(running))
        return [j for j in running if j.id in mine]

    def _plan(self, queue: list[Job], running: list[Job], busy: int, strict: bool) -> Plan:
        """Admission over ``queue`` (:func:`serving.jobs.admission.plan`), with what the
        executor has free less what the running jobs hold. ``strict``: an executor that does
        not answer ends the pass (:class:`ExecutorUnavailable`); else (answering a request)
        resources are left out of the reasons."""
        capacity = None
        if self.settings.jobs_admit_by_resources:
            live = {j.id for j in queue} | {j.id for j in running}
            capacity = self.resources.free(self._holding(running), live, strict)
        return plan(queue, running, busy=busy, slots=self.executor.concurrency,
                    executor=self.executor.name, settings=self.settings, capacity=capacity,
                    needs=self.resources.need, shape=self.executor.placement)

    def _admissible(self, recipe: str, overrides: dict[str, Any], nprocs: int, *,
                    recipe_checks: bool = True) -> dict[str, Any]:
        """:func:`~.validation.check_request` against this server's settings now, then a
        reachable executor (503) and a machine the job fits (422). Returns the overrides
        with their paths resolved."""
        overrides = validation.check_request(recipe, overrides, nprocs, self.settings,
                                             self.validate if recipe_checks else None)
        self.executor.check()
        self._check_fits(Job.model_construct(recipe=recipe, overrides=overrides, nprocs=nprocs))
        return overrides

    def _check_fits(self, draft: Job) -> None:
        if self.settings.jobs_admit_by_resources:
            self.resources.check_fits(draft)

    def _launch(self, job: Job) -> None:
        lease = {"host": self.host, "heartbeat_at": utcnow()} if self.executor.host_bound else {}
        claimed = self.store.transition(job.id, {JobState.queued}, state=JobState.running,
                                        started_at=utcnow(), attempts=job.attempts + 1, **lease)
        if claimed is None:
            return  # cancelled meanwhile, or another API process took it
        try:
            fields = self.executor.launch(claimed)
        except ExecutorUnavailable:  # nothing started: back in the queue
            self.store.transition(claimed.id, {JobState.running}, state=JobState.queued,
                                  started_at=None, attempts=job.attempts)
            raise
        except LaunchFailed as e:
            self.store.transition(claimed.id, {JobState.running}, state=JobState.failed,
                                  finished_at=utcnow(), reason=str(e))
            return
        # progress is read from here on; an earlier attempt's lines (before resuming) are skipped
        self._offsets[claimed.id] = claimed.log_path.stat().st_size
        if self.executor.host_bound:
            fields |= {"host": self.host, "heartbeat_at": utcnow()}
        self.store.update(claimed.id, **fields)

    def _follow(self, job_id: str) -> None:
        """Poll one attempt, read its new progress, record how it ended if it did."""
        job = self._get(job_id)
        outcome = self.executor.poll(job)
        if isinstance(outcome, NeverStarted):
            self._offsets.pop(job_id, None)
            self.store.transition(job_id, {JobState.running}, state=JobState.queued,
                                  started_at=None, attempts=max(0, job.attempts - 1))
            return
        _, self._offsets[job_id] = read_progress(self.store, job_id,
                                                 self._offsets.get(job_id, 0))
        match outcome:
            case Running(fields=fields) if fields:
                self.store.update(job_id, **fields)
            case Vanished(why=why):
                self._offsets.pop(job_id, None)
                self.leases.settle_from_log(self._get(job_id), why)
            case Ended(state=state, reason=reason, exit_code=code, fields=fields):
                self._offsets.pop(job_id, None)
                if self.executor.host_bound and job.host not in (None, self.host):
                    return  # settled and started again by another host meanwhile: not ours
                if self.store.transition(job_id, {JobState.running}, **fields, state=state,
                                         exit_code=code, finished_at=utcnow(), reason=reason,
                                         pid=None) is not None:
                    log.info("job %s %s (exit %s)", job_id, state.value, code)

    # --- helpers --------------------------------------------------------------------------------
    def _get(self, job_id: str) -> Job:
        job = self.store.get(job_id)
        if job is None:
            raise JobError(404, f"no job {job_id!r}")
        return job

    def _with_queue(self, found: list[Job]) -> list[Job]:
        """The jobs, the queued ones with their place in the queue and what they wait for."""
        if not any(j.state == JobState.queued for j in found):
            return found
        queue = self._queue()
        order = {job.id: i for i, job in enumerate(queue)}
        # from the table, not the executor: any API process (leader or not) answers the same
        running = self._running()
        busy = len(self._holding(running) if self.executor.host_bound else running)
        waiting = self._plan(queue, running, busy, strict=False).waiting_for
        out = []
        for job in found:
            pos = order.get(job.id)
            if job.state != JobState.queued or pos is None:
                out.append(job)
                continue
            out.append(job.model_copy(update={"queue_position": pos + 1,
                                              "waiting_for": waiting.get(job.id)}))
        return out
