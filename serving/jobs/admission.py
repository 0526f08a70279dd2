"""Admission: which queued jobs start now, and what each of the others waits for.

One pure function, :func:`plan`, over the queue in admission order (priority, then age), the
running jobs, the free slots and the free resources. The scheduler's pass starts what it says
starts, and every answer about a queued job (its ``waiting_for``) comes from the same plan, so
what a job is said to wait for is what actually holds it back.

The rules, in the order they are checked for each queued job (docs/jobs.md, "Admission"):

1. its owner is at ``jobs_max_running_per_key``: skipped (the next job may start);
2. it needs more than the machine (or every node of the cluster) has in all: skipped (locally
   such a job is refused at submit; on Ray an autoscaler may still add a node that fits);
3. a job ahead of it waits (below): it waits too, behind it (**strict order**);
4. no free slot (``executor.concurrency``), ``jobs_max_running`` reached, or its CPUs / GPUs
   not free: it waits, and so does everything behind it (rule 3);
5. otherwise it starts, and what it takes is no longer free for the jobs after it.

Strict order (rules 3-4) rather than skipping ahead to smaller jobs that fit: a big job is never
starved by a stream of small ones, at the price of idle resources while it waits for them to
drain. Priority is the way to let a small urgent job pass. The skips of rules 1-2 cannot starve
anyone: a job skipped for its owner's cap is held back only by its owner's own running jobs,
and one skipped for its size would not start even on an idle machine.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from serving.jobs.model import Job, JobError
from vit_service.config import DEFAULT_PRINCIPAL, Settings

Resources = dict[str, float]  # "CPU", "GPU" -> how many
RESOURCES = ("GPU", "CPU")  # in the order reasons name them
_EPS = 1e-9  # Ray reports fractional CPUs


def owner_of(job: Job) -> str:
    """The principal a job counts against: jobs from before owners were recorded were all
    submitted with VIT_SERVICE_API_KEY."""
    return job.owner or DEFAULT_PRINCIPAL


def amount(n: float, resource: str) -> str:
    """``2 GPUs``, ``1 CPU``, ``0.5 CPUs``."""
    return f"{n:g} {resource}{'' if n == 1 else 's'}"


def add(total: Iterable[Resources]) -> Resources:
    out: Resources = {}
    for r in total:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + v
    return out


@dataclass(frozen=True)
class Shape:
    """How a job's need is placed on nodes: as ``bundles`` equal parts (the workers of a
    multi-node job), each whole on one node, at most ``per_node`` of them on the same node;
    one bundle (the default): all of it on one node."""

    bundles: int = 1
    per_node: int | None = None

    def part(self, need: Resources) -> Resources:
        return {r: n / self.bundles for r, n in need.items() if n > 0}


@dataclass
class Node:
    """One machine: what it has in all, and what is free of it now (None: not read; the
    total less what running jobs hold, :meth:`Capacity.held`)."""

    total: Resources
    free: Resources | None = None

    def room(self, part: Resources, shape: Shape, free: bool = True) -> int:
        """How many ``part``s fit here (at most ``shape.per_node``)."""
        have = (self.free or {}) if free else self.total
        fit = min((math.floor((have.get(r, 0.0) + _EPS) / n) for r, n in part.items()),
                  default=shape.bundles)
        return max(0, fit if shape.per_node is None else min(fit, shape.per_node))


@dataclass
class Capacity:
    """What an executor has for jobs, as it reads it (:meth:`Executor.capacity`): its nodes
    (one for this machine), each with its total and, where the executor can see it, what is
    free now.

    ``cluster`` names a cluster in reasons (``"the Ray cluster"``; empty: this machine).
    ``elastic``: the totals may grow (an autoscaler adds nodes), so a job larger than all of
    it waits instead of being refused.
    """

    nodes: list[Node]
    cluster: str = ""
    elastic: bool = False
    pool_free: Resources = field(default_factory=dict)  # free in all, set by held()

    @property
    def total(self) -> Resources:
        return add(n.total for n in self.nodes)

    def held(self, held: Resources) -> Capacity:
        """This capacity with ``held`` (what the table's running jobs need) taken: a node
        with no reading of its own frees its total less that; a cluster's free in all is the
        smaller of what it reports and its total less that (its report lags a just-submitted
        job by a second or two, and counts other users' work, which the table does not)."""
        total = self.total
        nodes = [Node(dict(n.total), dict(n.free) if n.free is not None else
                      {r: v - held.get(r, 0.0) for r, v in n.total.items()})
                 for n in self.nodes]
        reported = add(n.free or {} for n in nodes)
        pool = {r: min(reported.get(r, 0.0), v - held.get(r, 0.0)) for r, v in total.items()}
        return Capacity(nodes, self.cluster, self.elastic, pool)

    def _room(self, need: Resources, shape: Shape, free: bool) -> int:
        """How many of the job's parts the nodes have room for."""
        part = shape.part(need)
        return sum(n.room(part, shape, free) for n in self.nodes) if part else shape.bundles

    def too_big(self, need: Resources, shape: Shape = Shape()) -> str | None:
        """What of ``need`` could not be had even with every job stopped, or None."""
        if self._room(need, shape, free=False) >= shape.bundles:
            return None
        if not self.cluster:  # this machine
            total = self.total
            return " and ".join(f"{amount(n, r)} (this machine has {total.get(r, 0.0):g})"
                                for r, n in _wanted(need) if n > total.get(r, 0.0) + _EPS)
        if not self.nodes:
            return None  # no report yet: short of free resources (shortfall), not of size
        if shape.bundles > 1:
            why = (f"{_workers(need, shape)} on {self.cluster} (room for "
                   f"{self._room(need, shape, free=False)} in all)")
        else:
            why = " and ".join(
                f"{amount(n, r)} on one node of {self.cluster} (the largest has "
                f"{max(node.total.get(r, 0.0) for node in self.nodes):g})"
                for r, n in _wanted(need))
        return f"{why}: waiting for the cluster to grow"

    def shortfall(self, need: Resources, shape: Shape = Shape()) -> str | None:
        """What of ``need`` is not free now (``"2 GPUs (0 of 2 free)"``, ``"4 CPUs on the
        Ray cluster (1 free)"``), or None if it fits."""
        total = self.total
        parts = []
        for r, n in _wanted(need):
            free = max(0.0, self.pool_free.get(r, 0.0))
            if n <= free + _EPS:
                continue
            if self.cluster:
                parts.append(f"{amount(n, r)} on {self.cluster} ({free:g} free)")
            else:
                parts.append(f"{amount(n, r)} ({free:g} of {total.get(r, 0.0):g} free)")
        if parts:
            return " and ".join(parts)
        room = self._room(need, shape, free=True)
        if room >= shape.bundles:
            return None
        if shape.bundles > 1:  # enough in all, not where whole workers fit
            return f"{_workers(need, shape)} on {self.cluster} (room for {room} now)"
        return " and ".join(
            f"{amount(n, r)} on one node of {self.cluster} ({self.pool_free.get(r, 0.0):g} free "
            f"in all, at most {max((node.free or {}).get(r, 0.0) for node in self.nodes):g} "
            "on one)" for r, n in _wanted(need))

    def take(self, need: Resources, shape: Shape = Shape()) -> None:
        """A job starts: what it needs is no longer free (each part on the first node with
        room for it)."""
        for r, n in need.items():
            self.pool_free[r] = self.pool_free.get(r, 0.0) - n
        part = shape.part(need)
        placed = {id(n): 0 for n in self.nodes}
        for _ in range(shape.bundles if part else 0):
            for node in self.nodes:
                if node.room(part, shape) > 0 and (shape.per_node is None
                                                   or placed[id(node)] < shape.per_node):
                    for r, n in part.items():
                        node.free[r] = node.free.get(r, 0.0) - n  # type: ignore[index]
                    placed[id(node)] += 1
                    break


def _workers(need: Resources, shape: Shape) -> str:
    """``3 workers of 1 CPU``."""
    each = " and ".join(amount(n, r) for r, n in _wanted(shape.part(need)))
    return f"{shape.bundles} workers of {each}"


def _wanted(need: Resources) -> list[tuple[str, float]]:
    return [(r, need[r]) for r in RESOURCES if need.get(r, 0.0) > 0] + \
        [(r, n) for r, n in need.items() if r not in RESOURCES and n > 0]


@dataclass
class Plan:
    start: list[Job]  # in admission order
    waiting_for: dict[str, str]  # queued job id -> why it has not started (or will next pass)


def plan(queue: list[Job], running: list[Job], *, busy: int, slots: int, executor: str,
         settings: Settings, capacity: Capacity | None,
         needs: Callable[[Job], Resources],
         shape: Callable[[Job], Shape] = lambda job: Shape()) -> Plan:
    """Which of ``queue`` (in admission order) start now, and why the others wait (module
    docstring). ``running``: every running job of the table (the caps count them all);
    ``busy``: the attempts held against ``slots`` (this executor's); ``capacity``: with what
    running jobs hold already taken (:meth:`Capacity.held`; drawn down here as jobs start),
    None where unknown or not asked for (then resources hold nothing back); ``needs`` and
    ``shape``: what a job holds while it runs, and how it is placed on nodes
    (:meth:`Executor.needs`, :meth:`Executor.placement`)."""
    s = settings
    by_owner = Counter(owner_of(j) for j in running)
    n_running = len(running)
    start: list[Job] = []
    why: dict[str, str] = {}
    blocked = False
    ahead = 0  # jobs ahead of the current one that start before it
    for job in queue:
        owner = owner_of(job)
        cap = s.jobs_max_running_per_key
        if cap is not None and by_owner[owner] >= cap:
            why[job.id] = f"the running cap of key {owner}: {by_owner[owner]} of {cap} running"
            continue
        need = needs(job) if capacity is not None else {}
        form = shape(job) if capacity is not None else Shape()
        if capacity is not None and (too_big := capacity.too_big(need, form)):
            why[job.id] = too_big
            continue
        if blocked:
            why[job.id] = f"{ahead} job{'s' * (ahead > 1)} ahead in the queue"
            ahead += 1
            continue
        reason = None
        if busy >= slots:
            reason = f"a free slot: {busy} of {slots} running ({executor})"
        elif s.jobs_max_running is not None and n_running >= s.jobs_max_running:
            reason = f"the global running cap: {n_running} of {s.jobs_max_running} running"
        elif capacity is not None:
            reason = capacity.shortfall(need, form)
        ahead += 1
        if reason is not None:
            blocked = True
            why[job.id] = reason
            continue
        start.append(job)
        why[job.id] = "the scheduler's next pass"
        busy += 1
        n_running += 1
        by_owner[owner] += 1
        if capacity is not None:
            capacity.take(need, form)
    return Plan(start, why)


def check_queued_caps(queued: list[Job], settings: Settings, owner: str) -> None:
    """429, saying which cap and by how much, when ``queued`` (the queue now) already holds
    ``jobs_max_queued`` jobs, or ``owner`` has ``jobs_max_queued_per_key`` of them."""
    s = settings
    if len(queued) >= s.jobs_max_queued:
        raise JobError(429, f"the job queue is full ({len(queued)} queued, the limit is "
                            f"{s.jobs_max_queued}: VIT_SERVICE_JOBS_MAX_QUEUED); retry "
                            "when one has started")
    mine = sum(owner_of(j) == owner for j in queued)
    if s.jobs_max_queued_per_key is not None and mine >= s.jobs_max_queued_per_key:
        raise JobError(429, f"key {owner} has {mine} jobs queued, its limit is "
                            f"{s.jobs_max_queued_per_key} (VIT_SERVICE_JOBS_MAX_QUEUED_"
                            "PER_KEY); retry when one of them has started")
