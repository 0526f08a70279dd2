"""Running batches: one generic runner for both modalities, and the service that feeds it.

Everything here is blocking and runs in the single inference thread (so the event loop stays
free and torch's own threads are not oversubscribed). Within a batch, jobs are run in up to
three groups by their :class:`vit_service.pipeline.ForwardPath`; each group is decoded by its
modality's codec (:mod:`serving.codecs`), explained by one call of
:func:`vit_service.pipeline.explain_batch` and its answers encoded once. A group that fails is
run again job by job, so one request's bad input fails that request only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from serving.batching import MicroBatcher
from serving.codecs import CODECS, BatchArrays, ImageInput, ImageJob, Job, Result, TextJob
from serving.errors import InvalidRequestError, ModelNotLoadedError, OverloadedError
from serving.explanations import ExplainSpec, relevance_refused
from serving.metrics import ServingMetrics
from serving.model_store import LoadedModel, ModelStore
from vit_service.config import Settings
from vit_service.pipeline import ForwardPath, explain_batch

log = logging.getLogger(__name__)

__all__ = ["ImageInput", "ImageJob", "InferenceService", "Job", "JobOutput", "TextJob",
           "lane_of", "run_jobs"]


@dataclass
class JobOutput:
    model: LoadedModel  # the version that computed these results
    results: list[Result]  # one per input


Observe = Callable[[str, float], None]  # (stage, seconds) -> metrics


def _no_observe(stage: str, seconds: float) -> None:
    pass


class _Clock:
    """Laps of one batch group, reported per stage once the group has succeeded (a failed
    group's laps would count its stages twice when its jobs are run again alone)."""

    def __init__(self, observe: Observe) -> None:
        self.observe, self.t = observe, time.perf_counter()
        self.laps: list[tuple[str, float]] = []

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps.append((stage, now - self.t))
        self.t = now

    def report(self) -> None:
        for stage, seconds in self.laps:
            self.observe(stage, seconds)


def _groups(jobs: Sequence[Job]) -> dict[ForwardPath, list[int]]:
    """Job indices by forward path (fused / explicit attention / with gradients)."""
    out: dict[ForwardPath, list[int]] = {}
    for i, job in enumerate(jobs):
        out.setdefault(job.spec.path, []).append(i)
    return out


class _GroupFailed(Exception):
    """A group's error and where it arose: decoding its inputs (``preprocess``) or after."""

    def __init__(self, error: Exception, preprocess: bool) -> None:
        super().__init__(str(error))
        self.error, self.preprocess = error, preprocess


def _failure(model: LoadedModel, path: ForwardPath, failed: _GroupFailed) -> Exception:
    """What a failed group answers. A failing relevance pass is the model's limit, not the
    request's fault nor a crash: the version is marked unable to give relevance (later
    requests get the 422 up front, the card says so) and this one gets that 422 too. An
    input that could not be decoded says nothing about the model's relevance pass; a failure
    after decoding (the pass, or encoding its answer) counts against the version."""
    e = failed.error
    if (path is ForwardPath.RELEVANCE and not failed.preprocess
            and not isinstance(e, InvalidRequestError)):
        reason = f"its relevance pass failed in {model.precision} ({type(e).__name__})"
        model.mark_relevance_unavailable(reason)
        return relevance_refused(model.name, reason)
    return e


def _run_group(model: LoadedModel, group: Sequence[Job], observe: Observe) -> list[JobOutput]:
    """Decode, explain and encode one group of jobs that share a forward path."""
    codec = CODECS[model.task]
    clock = _Clock(observe)
    try:
        inputs, ctx = codec.batch(model, group)  # type: ignore[arg-type]
    except Exception as e:
        raise _GroupFailed(e, preprocess=True) from e
    try:
        clock.lap("preprocess")
        specs = [job.spec for job in group for _ in range(job.size)]  # one per row
        res = explain_batch(model.bundle.model, inputs, specs, model.forwards, clock.lap)
        arrays, row, outputs = BatchArrays(res), 0, []
        for job in group:
            results = []
            for item in job.items:
                results.append(codec.encode(model, job, item, row, res, arrays, ctx))  # type: ignore[arg-type]
                row += 1
            outputs.append(JobOutput(model, results))
        clock.lap("results")
    except Exception as e:
        raise _GroupFailed(e, preprocess=False) from e
    clock.report()
    return outputs


def run_jobs(model: LoadedModel, jobs: Sequence[Job],
             observe: Observe = _no_observe) -> list[JobOutput | Exception]:
    """Every job of a batch (all of ``model``'s modality), grouped by forward path: decode,
    explain, encode. When a group of several jobs fails, each of its jobs is run again alone,
    so one request's bad input answers that request only, not the others batched with it."""
    outputs: list[JobOutput | Exception] = [InvalidRequestError("not run")] * len(jobs)
    for path, idxs in _groups(jobs).items():
        group = [jobs[i] for i in idxs]
        try:
            done = _run_group(model, group, observe)
        except _GroupFailed as failed:
            if len(group) == 1:
                log.error("%s batch failed for %s", model.task, model.name, exc_info=failed.error)
                outputs[idxs[0]] = _failure(model, path, failed)
                continue
            log.warning("%s batch of %d jobs failed for %s (%s: %s); running each alone",
                        model.task, len(group), model.name, type(failed.error).__name__, failed)
        else:
            for i, out in zip(idxs, done, strict=True):
                outputs[i] = out
            continue
        for i, job in zip(idxs, group, strict=True):
            reason = model.relevance_unavailable
            if path is ForwardPath.RELEVANCE and reason:  # a job alone failed in the model
                outputs[i] = relevance_refused(model.name, reason)
                continue
            try:
                [outputs[i]] = _run_group(model, [job], observe)
            except _GroupFailed as failed:
                log.error("%s job failed for %s", model.task, model.name, exc_info=failed.error)
                outputs[i] = _failure(model, path, failed)
    return outputs


PLAIN, EXPLAIN = "plain", "explain"
COST_ALPHA = 0.2  # weight of the newest batch in the moving average of seconds per input


def lane_of(spec: ExplainSpec) -> str:
    """Relevance and faithfulness cost a backward pass or ~55 forwards per input: a lane of
    their own, with its own admission cap and small batches."""
    return EXPLAIN if spec.relevance or spec.faithfulness else PLAIN


class InferenceService:
    """One micro-batcher per served model and lane, all feeding one inference thread.

    Admission: the inputs admitted and not yet answered are counted per lane, and each lane
    keeps a moving average of the seconds one input costs; a request that would take its lane
    past ``max_queued_items`` / ``max_queued_explain_items``, or whose estimated wait (inputs
    ahead and its own x seconds per input, when inputs are ahead of it) passes
    ``max_queue_wait_s``, gets 503 with ``Retry-After`` at
    once (the routes ask before reading the body, and again with the exact size), and one not
    answered within ``request_timeout_s`` gets 503 too (its job is skipped if its batch has
    not started). The one inference thread takes batches
    from the lanes' batchers in turn, and an explain batch holds at most ``explain_batch_size``
    inputs, so plain predictions stay responsive while explanations are queued."""

    def __init__(
        self, store: ModelStore, settings: Settings, metrics: ServingMetrics | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._batchers: dict[tuple[str, str], MicroBatcher[Job, JobOutput]] = {}
        self.queued = {PLAIN: 0, EXPLAIN: 0}  # inputs admitted and not yet answered
        self.per_input_s: dict[str, float | None] = {PLAIN: None, EXPLAIN: None}

    def _cap(self, lane_: str) -> int:
        s = self.settings
        return s.max_queued_explain_items if lane_ == EXPLAIN else s.max_queued_items

    def batcher(self, name: str, lane_: str = PLAIN) -> MicroBatcher[Job, JobOutput]:
        b = self._batchers.get((name, lane_))
        if b is None:
            def on_batch(n: int, seconds: float, name: str = name, ln: str = lane_) -> None:
                cost, prev = seconds / max(1, n), self.per_input_s[ln]
                self.per_input_s[ln] = cost if prev is None else prev + COST_ALPHA * (cost - prev)
                if self.metrics is not None:
                    self.metrics.batch_size.labels(name).observe(n)
                    self.metrics.batch_seconds.labels(name).observe(seconds)

            def on_wait(seconds: float, name: str = name) -> None:
                self.observe(name, "queue", seconds)

            size = self.settings.max_batch_size
            if lane_ == EXPLAIN:
                size = min(size, self.settings.explain_batch_size)
            b = MicroBatcher(
                f"{name}/{lane_}", lambda jobs, name=name: self._process(name, jobs),
                self.executor, size, self.settings.max_wait_ms, on_batch, on_wait,
                adaptive=self.settings.adaptive_wait,
            )
            self._batchers[(name, lane_)] = b
        return b

    def observe(self, name: str, stage: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.stage_seconds.labels(name, stage).observe(seconds)

    def _process(self, name: str, jobs: list[Job]) -> list[JobOutput | Exception]:
        model = self.store.get(name)  # the version current when the batch starts
        if model is None:
            return [ModelNotLoadedError(name)] * len(jobs)
        want = CODECS[model.task].job_type
        if not all(isinstance(j, want) for j in jobs):
            return [InvalidRequestError(f"model {name!r} is a {model.task} model")] * len(jobs)
        # a target was checked against the version current at request time; a reload since
        # may have fewer classes: fail only those jobs
        n = len(model.class_names)
        bad = {i for i, j in enumerate(jobs) if j.spec.target is not None and j.spec.target >= n}
        if bad:
            ok = [j for i, j in enumerate(jobs) if i not in bad]
            done = iter(self._run(model, ok) if ok else [])
            return [InvalidRequestError(f"target index {j.spec.target} is not a class of "
                                        f"{name!r} v{model.version}") if i in bad else next(done)
                    for i, j in enumerate(jobs)]
        return self._run(model, jobs)

    def _run(self, model: LoadedModel, jobs: list[Job]) -> list[JobOutput | Exception]:
        name = model.name

        def observe(stage: str, seconds: float) -> None:
            self.observe(name, stage, seconds)

        return run_jobs(model, jobs, observe)

    def admit(self, ln: str, size: int = 1) -> None:
        """503 with Retry-After if ``size`` more inputs would overfill lane ``ln``: past its cap
        in inputs, or past ``max_queue_wait_s`` of estimated wait."""
        cap = self._cap(ln)
        if self.queued[ln] + size > cap:
            self._shed(ln, "full")
            raise OverloadedError(f"the {ln} queue is full ({self.queued[ln]} of {cap} inputs "
                                  "waiting); retry shortly", retry_after_s=1)
        per = self.per_input_s[ln]
        wait = (self.queued[ln] + size) * per if per is not None else 0.0
        # a request alone in its lane waits for nothing: it is admitted whatever its size (that
        # is capped per request), else a slow first batch's estimate would shed every large one
        if self.queued[ln] and wait > self.settings.max_queue_wait_s:
            self._shed(ln, "wait")
            raise OverloadedError(f"the {ln} queue would hold this request ~{wait:.1f}s; retry "
                                  "shortly", retry_after_s=math.ceil(wait))

    async def predict(self, name: str, job: Job) -> JobOutput:
        ln = lane_of(job.spec)
        self.admit(ln, job.size)
        self._count(ln, job.size)
        try:
            return await asyncio.wait_for(self.batcher(name, ln).submit(job, job.size),
                                          self.settings.request_timeout_s)
        except TimeoutError:
            self._shed(ln, "deadline")
            raise OverloadedError(f"not answered within {self.settings.request_timeout_s:g}s "
                                  "(the server is busy); retry shortly",
                                  retry_after_s=2) from None
        finally:
            self._count(ln, -job.size)

    def _count(self, ln: str, n: int) -> None:
        self.queued[ln] += n
        if self.metrics is not None:
            self.metrics.queue_items.labels(ln).set(self.queued[ln])

    def _shed(self, ln: str, why: str) -> None:
        if self.metrics is not None:
            self.metrics.shed.labels(ln, why).inc()

    async def close(self) -> None:
        for b in self._batchers.values():
            await b.close()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
