"""Dynamic micro-batching: concurrent requests for one model share a forward pass.

Each request submits one *job* (its images or texts, never split, so a response comes from a
single model version). A consumer task takes the first waiting job, then keeps adding jobs
while the batch has fewer than ``max_batch_size`` inputs and the first job has waited less than
``max_wait_ms``; the batch runs in the inference thread and each job gets its own slice back.
While a batch runs, new jobs queue up, so under load batches grow by themselves even with
``max_wait_ms = 0``.

Adaptive wait (``adaptive=True``, the server's default): the window is only opened when another
request is expected inside it, i.e. when the recent gap between submissions (an exponential
moving average) is at most ``max_wait_ms``. A lone request, or a client that sends one request
at a time, then waits ~0 instead of the whole window (at low concurrency a fixed window is a
large share of each request's time, docs/serving.md), while a dense stream still fills its
batches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

J = TypeVar("J")  # a job: one request's inputs
R = TypeVar("R")  # its result

GAP_ALPHA = 0.25  # weight of the newest gap in the moving average (~4 submissions of memory)
GAP_CAP = 4.0  # a gap longer than 4 windows counts as 4 windows: after an idle spell, a burst
# is recognised within ~5 submissions instead of dozens


@dataclass
class _Pending(Generic[J, R]):
    job: J
    size: int
    future: asyncio.Future[R]
    enqueued: float = field(default_factory=time.monotonic)


class MicroBatcher(Generic[J, R]):
    """Queue + consumer task for one model.

    ``process(jobs)`` runs in ``executor`` and returns one result (or exception) per job, in
    order. ``on_batch(n_inputs, seconds)`` is called after each batch, ``on_wait(seconds)``
    with each job's time in the queue when its batch starts (metrics).
    """

    def __init__(
        self,
        name: str,
        process: Callable[[list[J]], Sequence[R | BaseException]],
        executor: Executor,
        max_batch_size: int,
        max_wait_ms: float,
        on_batch: Callable[[int, float], None] | None = None,
        on_wait: Callable[[float], None] | None = None,
        adaptive: bool = False,
    ) -> None:
        self.name = name
        self.process = process
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.on_batch = on_batch
        self.on_wait = on_wait  # called with each job's queue wait when its batch starts
        self.adaptive = adaptive  # open the window only when another job is expected in it
        self._last_arrival: float | None = None
        self._gap_s = math.inf  # moving average of the gaps between submissions (no data: inf)
        self._queue: asyncio.Queue[_Pending[J, R]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._carry: _Pending[J, R] | None = None
        self.batches = 0  # batches run so far (tests, debugging)
        self.last_window_s = 0.0  # the window the latest batch could wait for (tests)

    def _ensure_started(self) -> asyncio.Queue[_Pending[J, R]]:
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._consume(self._queue), name=f"batcher-{self.name}"
            )
        assert self._queue is not None
        return self._queue

    async def submit(self, job: J, size: int) -> R:
        """Queue ``job`` (``size`` inputs) and wait for its result."""
        queue = self._ensure_started()
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        pending = _Pending(job, size, future)
        self._note_arrival(pending.enqueued)
        await queue.put(pending)
        return await future

    def _note_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            gap = min(now - self._last_arrival, GAP_CAP * self.max_wait_s)
            self._gap_s = gap if math.isinf(self._gap_s) else \
                self._gap_s + GAP_ALPHA * (gap - self._gap_s)
        self._last_arrival = now

    def wait_window_s(self) -> float:
        """How long the next batch may wait for more jobs after its first one."""
        if not self.adaptive or self._gap_s <= self.max_wait_s:
            return self.max_wait_s
        return 0.0

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._queue is not None:  # fail whatever is still waiting
            pending = [self._carry] if self._carry is not None else []
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            for p in pending:
                if not p.future.done():
                    p.future.cancel()
        self._queue, self._carry = None, None

    async def _collect(self, queue: asyncio.Queue[_Pending[J, R]]) -> list[_Pending[J, R]]:
        first = self._carry if self._carry is not None else await queue.get()
        self._carry = None
        batch, n = [first], first.size
        self.last_window_s = self.wait_window_s()
        deadline = first.enqueued + self.last_window_s
        while n < self.max_batch_size:
            try:
                nxt = queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
            if n + nxt.size > self.max_batch_size:
                self._carry = nxt  # starts the next batch
                break
            batch.append(nxt)
            n += nxt.size
        return batch

    async def _consume(self, queue: asyncio.Queue[_Pending[J, R]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._collect(queue) if not p.future.done()]
            if not batch:
                continue  # every waiter went away
            n = sum(p.size for p in batch)
            if self.on_wait is not None:
                now = time.monotonic()
                for p in batch:
                    self.on_wait(now - p.enqueued)
            start = time.perf_counter()

            def run(batch: list[_Pending[J, R]] = batch) -> tuple[list[_Pending[J, R]], Sequence]:
                # the executor may start this late (another batch held the thread): jobs
                # whose caller gave up meanwhile (a deadline) are dropped, not computed
                live = [p for p in batch if not p.future.done()]
                return live, (self.process([p.job for p in live]) if live else [])

            try:
                batch, results = await loop.run_in_executor(self.executor, run)
            except asyncio.CancelledError:
                for p in batch:
                    if not p.future.done():
                        p.future.cancel()
                raise
            except Exception as e:  # the whole batch failed
                log.exception("batch of %d for %s failed", n, self.name)
                results = [e] * len(batch)
            if not batch:
                continue
            self.batches += 1
            if self.on_batch is not None:
                self.on_batch(sum(p.size for p in batch), time.perf_counter() - start)
            for p, r in zip(batch, results, strict=True):
                if p.future.done():
                    continue
                if isinstance(r, BaseException):
                    p.future.set_exception(r)
                else:
                    p.future.set_result(r)
