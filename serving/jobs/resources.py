"""What an executor has and what each job holds: the resource side of admission.

The manager asks two questions of it: how much is free for the queued jobs (the executor's
capacity less what the running jobs hold), and whether a job could ever fit (a 422 at submit
time, rather than a job queued forever). Readings of a Ray head lag and may hang, so a reading
is reused for ``CAPACITY_TTL_S`` and a request being answered never waits on one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable

from serving.jobs.admission import Capacity, Resources, add
from serving.jobs.executor import Executor, ExecutorUnavailable
from serving.jobs.model import Job, JobError

log = logging.getLogger(__name__)

CAPACITY_TTL_S = 1.0  # an executor's resource reading is reused this long (a Ray head's lags)


class ResourceView:
    """An executor's capacity (read at most every ``CAPACITY_TTL_S``) and each job's needs
    (read once per job, forgotten when the job is neither queued nor running)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._needs: dict[str, Resources] = {}  # job id -> what it holds running
        # the last reading: when, what, whether the executor answered
        self._read: tuple[float, Capacity | None, bool] = (-math.inf, None, True)
        self._lock = threading.Lock()  # one reading at a time

    def free(self, holding: Iterable[Job], live: set[str], strict: bool) -> Capacity | None:
        """The capacity less what ``holding`` (the running jobs on these resources) holds;
        None when unknown. Needs of jobs not in ``live`` (queued or running ids) are dropped.
        ``strict``: an executor that does not answer raises :class:`ExecutorUnavailable`
        (ending a scheduling pass); else (answering a request) the answer is None."""
        capacity = self.capacity(strict)
        if capacity is not None:
            capacity = capacity.held(add(self.need(j) for j in holding))
        for job_id in list(self._needs):  # a copy: requests' threads add to it meanwhile
            if job_id not in live:
                self._needs.pop(job_id, None)
        return capacity

    def capacity(self, strict: bool) -> Capacity | None:
        """The executor's reading of its resources (a request to a Ray head), reused for
        CAPACITY_TTL_S. Not ``strict`` (a request being answered): never waits on another
        thread's reading (the last one is used meanwhile), and a failed reading is remembered
        as unknown for as long, so a head that hangs delays one request, not every one."""
        at, cap, answered = self._read
        if time.monotonic() - at < CAPACITY_TTL_S and (answered or not strict):
            return cap
        if not self._lock.acquire(blocking=strict):
            return cap
        try:
            cap = self.executor.capacity()
        except ExecutorUnavailable:
            self._read = (time.monotonic(), None, False)
            if strict:
                raise
            return None
        finally:
            self._lock.release()
        self._read = (time.monotonic(), cap, True)
        return cap

    def need(self, job: Job) -> Resources:
        """What ``job`` holds while it runs (:meth:`Executor.needs`), read once per job. A
        recipe that no longer loads holds nothing here (its attempt fails on its own)."""
        need = self._needs.get(job.id)
        if need is None:
            try:
                need = self.executor.needs(job)
            except Exception as e:  # noqa: BLE001 (any recipe error: admission goes on)
                log.warning("job %s: its needs are unknown (%s: %s); admitted by slots alone",
                            job.id, type(e).__name__, e)
                need = {}
            # a local, then setdefault: another thread may prune the cache between the two
            need = self._needs.setdefault(job.id, need)
        return need

    def check_fits(self, draft: Job) -> None:
        """422 for a job larger than all this executor has (it could never start), where
        that cannot grow (a cluster's autoscaler may add nodes: there it waits)."""
        capacity = self.capacity(strict=False)
        if capacity is None or capacity.elastic:
            return
        try:
            need = self.executor.needs(draft)
        except Exception:  # noqa: BLE001 (validated already; a stand-in recipe in tests)
            return
        if (too_big := capacity.too_big(need, self.executor.placement(draft))) is not None:
            raise JobError(422, f"this job needs {too_big}: it could never start here "
                                "(VIT_SERVICE_JOBS_CPUS / VIT_SERVICE_JOBS_GPUS); ask for "
                                "fewer processes, threads or another device")
