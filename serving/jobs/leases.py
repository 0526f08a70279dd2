"""Leases of host-bound attempts, and settling attempts whose exit status nobody can know.

A local process is bound to the API host that started it: that host renews a lease on each of
its running jobs (``heartbeat_at``) every third of ``jobs_lease_s``. Another host leaves such a
job alone while its lease is fresh (a pid means nothing across hosts) and settles it from its
log once the lease has expired (the host died, or lost the database). The same settling serves
a job whose process was gone when the API server restarted.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from pathlib import Path

from serving.jobs.executor import CANCEL_REQUESTED, Executor
from serving.jobs.model import Job, JobState
from serving.jobs.progress import last_event, read_progress
from serving.jobs.store import JobStore, utcnow
from training.progress import Event, RunStatus

log = logging.getLogger(__name__)

# an `end` event with one of these says the run succeeded (the last: a job runner's own word)
SUCCESS_STATUSES = (RunStatus.finished, RunStatus.stopped, JobState.succeeded)


def host_id() -> str:
    """This machine in the job store: its hostname and boot id (a rebooted host is another
    host: none of its earlier processes survived)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "0"
    return f"{socket.gethostname()}/{boot}"


class Leases:
    """This host's leases in ``store`` and the settling of other hosts' expired ones."""

    def __init__(self, store: JobStore, executor: Executor, host: str, lease_s: float,
                 get: Callable[[str], Job], recover: Callable[[Job], object]) -> None:
        """``get(job_id)``: the job as stored now (404 when it is gone). ``recover(job)``:
        adopt or settle one of this host's attempts that no process follows any more."""
        self.store, self.executor, self.host, self.lease_s = store, executor, host, lease_s
        self.get, self.recover = get, recover
        self.renewed = -math.inf  # monotonic time of the last renewal

    def renew(self, settle_others: bool = True) -> None:
        """Every third of a lease: renew the leases of the attempts this process follows,
        and (``settle_others``: the leader only) settle other hosts' expired ones and recover
        this host's that nobody renews (their process was another API process of this host,
        a `--workers N` sibling that led before, and it is gone)."""
        if time.monotonic() - self.renewed < self.lease_s / 3:
            return
        self.renewed = time.monotonic()
        running = self.store.list(JobState.running, limit=10_000)
        mine = self.executor.following(running)
        self.store.heartbeat(mine, self.host)
        if not settle_others:
            return
        for job in running:
            if job.id in mine or job.executor not in (None, self.executor.name):
                continue  # ours, or another executor's job (a Ray job follows itself)
            if job.host not in (None, self.host):
                self.settle_if_expired(job)
            elif self.expired(job):
                self.recover(job)

    def expired(self, job: Job) -> bool:
        """Whether nobody renewed the job's lease for a whole lease."""
        beat = job.heartbeat_at or job.started_at
        return beat is None or (utcnow() - beat).total_seconds() >= self.lease_s

    def settle_if_expired(self, job: Job) -> None:
        """Another host's running job: left alone while that host renews its lease (its
        process is not ours to check); settled from its log once the lease has expired."""
        if not self.expired(job):
            return
        if job.executor not in (None, self.executor.name):
            return  # another executor's job (a Ray job): it follows it itself
        read_progress(self.store, job.id, 0)
        self.settle_from_log(self.get(job.id), f"its API host {job.host} stopped renewing "
                                               "its lease")

    def settle_from_log(self, job: Job, why: str) -> None:
        """Settle a job whose exit status we cannot know, from what its log says."""
        end = last_event(job.log_path, Event.end)
        if job.reason == CANCEL_REQUESTED:
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
