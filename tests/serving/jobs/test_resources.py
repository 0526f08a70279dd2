"""serving/jobs/resources.py: capacity readings reused and never waited on by requests, needs
read once per job and forgotten with it, and the 422 for a job that could never fit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from serving.jobs.admission import Capacity
from serving.jobs.executor import ExecutorUnavailable
from serving.jobs.local import LocalExecutor
from serving.jobs.model import Job, JobError
from serving.jobs.resources import CAPACITY_TTL_S, ResourceView
from vit_service.config import Settings


class SlowHead(LocalExecutor):
    """The local executor whose capacity reading can be made to hang or fail, as a Ray head's
    can; every reading is counted."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.readings = 0
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def capacity(self) -> Capacity:
        self.readings += 1
        self.release.wait(10)
        if self.fail:
            raise ExecutorUnavailable(503, "the head does not answer")
        return super().capacity()


def _job(job_id: str, **overrides: object) -> Job:
    return Job.model_construct(id=job_id, recipe="cifar10-smoke", overrides=dict(overrides),
                               nprocs=1)


@pytest.fixture
def head(tmp_path: Path) -> SlowHead:
    return SlowHead(Settings(home=tmp_path, jobs_cpus=4, jobs_gpus=0))


def test_a_reading_is_reused_for_its_ttl_then_read_again(head: SlowHead) -> None:
    view = ResourceView(head)
    first = view.capacity(strict=True)
    assert first is not None and first.total == {"CPU": 4.0, "GPU": 0.0}
    assert view.capacity(strict=True) is first and view.capacity(strict=False) is first
    assert head.readings == 1
    time.sleep(CAPACITY_TTL_S + 0.05)
    assert view.capacity(strict=True) is not first and head.readings == 2


def test_a_request_never_waits_on_a_reading_that_hangs(head: SlowHead) -> None:
    view = ResourceView(head)
    before = view.capacity(strict=True)
    time.sleep(CAPACITY_TTL_S + 0.05)
    head.release.clear()  # the next reading hangs
    scheduler = threading.Thread(target=view.capacity, args=(True,))
    scheduler.start()
    try:
        while head.readings < 2:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert view.capacity(strict=False) is before  # the last reading, at once
        assert time.monotonic() - t0 < 1.0
    finally:
        head.release.set()
        scheduler.join(10)
    assert head.readings == 2


def test_a_failed_reading_raises_for_the_scheduler_and_is_unknown_to_requests(
        head: SlowHead) -> None:
    head.fail = True
    view = ResourceView(head)
    with pytest.raises(ExecutorUnavailable):
        view.capacity(strict=True)
    assert view.capacity(strict=False) is None  # remembered as unknown: not read again
    assert head.readings == 1
    with pytest.raises(ExecutorUnavailable):  # the scheduler reads again, strict
        view.capacity(strict=True)
    assert head.readings == 2


def test_free_takes_what_running_jobs_hold_and_forgets_ended_jobs(head: SlowHead) -> None:
    view = ResourceView(head)
    running = [_job("a"), _job("b", threads=2)]
    free = view.free(running, live={"a", "b"}, strict=True)
    assert free is not None and free.pool_free == {"CPU": 4.0 - 1.0 - 2.0, "GPU": 0.0}
    assert view.need(running[1]) == {"CPU": 2.0}
    # "a" ended: its need is dropped, and read again if it ever runs again
    view.free([running[1]], live={"b"}, strict=True)
    assert set(view._needs) == {"b"}


def test_a_job_larger_than_the_machine_is_refused_with_422(head: SlowHead) -> None:
    view = ResourceView(head)
    view.check_fits(_job("fits", threads=2))
    with pytest.raises(JobError) as e:
        view.check_fits(_job("gpu", device="cuda"))
    assert e.value.status == 422 and "GPU" in str(e.value)
