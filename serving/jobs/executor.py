"""Where a job's attempts run: the :class:`Executor` protocol the job manager launches through,
and what a poll of an attempt answers.

Two executors: local processes (:mod:`serving.jobs.local`) and a Ray cluster
(:mod:`serving.jobs.ray_jobs`). The manager owns everything else (the queue, the checks, the
store, progress; leases through :mod:`serving.jobs.leases`); an executor starts, watches and
stops attempts, and never decides a job's state on its own: a poll says what it saw, the
manager records it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from serving.jobs.admission import Capacity, Shape
from serving.jobs.model import Job, JobError, JobState

CANCEL_REQUESTED = "cancel requested"  # a running job's reason from its cancel until it stops


class ExecutorUnavailable(JobError):
    """Where the jobs run does not answer (503): nothing was started; retried next pass."""


class LaunchFailed(Exception):
    """The attempt could not start: the job fails with this reason."""


@dataclass(frozen=True)
class Running:
    """Still running; ``fields`` to record now (the executor, a reason)."""

    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ended:
    """The attempt ended, and the executor knows how; ``fields``: more to record."""

    state: JobState
    reason: str | None = None
    exit_code: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Vanished:
    """The attempt ended, its exit status unknown: settled from what its log says."""

    why: str


@dataclass(frozen=True)
class NeverStarted:
    """The attempt never reached the executor (its claimer died first): queue the job again."""


Poll = Running | Ended | Vanished | NeverStarted


class Executor(Protocol):
    name: str  # the job row's ``executor`` once an attempt started here: local | ray
    # True: attempts are processes of this host, followed by the API process that started
    # them (or re-adopted them), under a lease. False: every API process follows every
    # running attempt from the table (a cluster shared by the API replicas).
    host_bound: bool
    concurrency: int  # attempts at once

    def start(self) -> None:
        """Before the scheduler's first pass."""

    def check(self) -> None:
        """Before a valid job is queued: raise :class:`JobError` if nothing could run it."""

    def launch(self, job: Job) -> dict[str, Any]:
        """Start the claimed job's attempt, with its output appended to ``job.log_path``.
        Returns the fields to record; raises :class:`LaunchFailed` (the job fails) or
        :class:`ExecutorUnavailable` (it is queued again)."""

    def forget(self, keep: Collection[str] = ()) -> None:
        """Drop every attempt followed so far but those of the jobs in ``keep`` (at a start
        after a step-down: what is still this host's was adopted again from the table)."""

    def followed_elsewhere(self, job: Job) -> bool:
        """Whether another live process of this host follows the job's attempt (the one that
        started it): then it is left to that process while its lease is renewed."""

    def adopt(self, job: Job) -> bool:
        """Follow a running attempt (again): one still followed keeps its handle, one found
        by its pid after a restart is followed by pid. False if it is gone."""

    def following(self, running: list[Job]) -> list[str]:
        """The jobs to poll this pass (``running``: the table's running jobs)."""

    def poll(self, job: Job) -> Poll:
        """What became of the job's attempt (its new output is in ``job.log_path`` after)."""

    def stop(self, job: Job) -> None:
        """Ask the attempt to stop: SIGTERM (it checkpoints), SIGKILL after the grace."""

    def needs(self, job: Job) -> dict[str, float]:
        """What one attempt of ``job`` holds while it runs ("CPU", "GPU"), from its recipe:
        admission starts it only when that much is free (:mod:`serving.jobs.admission`)."""

    def placement(self, job: Job) -> Shape:
        """How the job's needs are placed on nodes: all on one (a process, or torchrun on one
        machine), or as workers each on a node of its own (Ray Train)."""

    def capacity(self) -> Capacity | None:
        """What there is for jobs: each node's total, and what is free where the executor can
        read it (else the manager takes the running jobs' needs off the total). None: not
        known now (jobs are then admitted by slots alone)."""
