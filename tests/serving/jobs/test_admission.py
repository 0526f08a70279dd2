"""Admission (serving/jobs/admission.py): the queued and running caps, global and per API key,
and resource-aware starts, with the real manager, job store and local executor, the real app
for the principals, and a real Ray head for the cluster's resources.

A tiny worker process stands in for `vit-service train` (as in test_manager.py): it runs until
the test drops a ``release`` file in its run folder. The jobs name a real recipe, so what they
need is read from it; the machine's CPUs and GPUs are set through ``jobs_cpus`` / ``jobs_gpus``
(the way an operator sets them), so GPU admission is tested on a machine without one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serving.jobs import JobError, JobManager, JobState
from serving.jobs.admission import Capacity, Node, Shape
from serving.jobs.local import LocalExecutor
from serving.jobs.model import Job
from serving.jobs.validation import validate_recipe
from vit_service.config import Settings

WORKER = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
print(json.dumps({"event": "start"}), flush=True)
while not os.path.exists("release"):
    time.sleep(0.02)
print(json.dumps({"event": "end", "status": "succeeded"}), flush=True)
"""
SMOKE = "cifar10-smoke"
CPU1 = {"device": "cpu", "threads": 1}  # one CPU, no GPU
GPU1 = {"device": "cuda", "threads": 1}  # a GPU and a CPU per process


def _command(job: Job) -> list[str]:
    return [sys.executable, "-c", WORKER]


def _validate(recipe: str, overrides: dict[str, Any]) -> None:
    """The recipe schema's own check, without the data set and model-size checks (there is no
    data set here: the worker trains nothing)."""
    validate_recipe(recipe, overrides)


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = dict(home=tmp_path / "home", data_dir=tmp_path / "data",
                                jobs_poll_s=0.05, jobs_cancel_grace_s=5, jobs_concurrency=4,
                                jobs_cpus=4, jobs_gpus=0)
    return Settings(**(base | kw))


def _manager(settings: Settings) -> JobManager:
    return JobManager(settings, executor=LocalExecutor(settings, command=_command),
                      validate=_validate)


def _refused(call: Callable[[], Any]) -> JobError:
    with pytest.raises(JobError) as e:
        call()
    return e.value


def _until(mgr: JobManager, done: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mgr.tick()
        if done():
            return
        time.sleep(0.05)
    raise AssertionError(f"not reached: {[(j.name, j.state) for j in mgr.list()]}")


def _release(mgr: JobManager, *jobs: Job) -> None:
    """Let the jobs' workers end, and follow them to the end."""
    for job in jobs:
        (Path(job.run_dir) / "release").touch()
    _until(mgr, lambda: all(mgr.get(j.id).state == JobState.succeeded for j in jobs))


@pytest.fixture
def managers() -> Iterator[list[JobManager]]:
    """Managers whose workers still run at the end are released (no process outlives a
    test)."""
    made: list[JobManager] = []
    yield made
    for mgr in made:
        running = mgr.list(JobState.running)
        for job in running:
            (Path(job.run_dir) / "release").touch()
        for p in mgr.executor.procs.values():
            if p.proc is not None:
                p.proc.wait(10)


def test_queued_caps_answer_429_naming_the_cap_and_the_numbers(tmp_path: Path) -> None:
    mgr = _manager(_settings(tmp_path, jobs_max_queued=4, jobs_max_queued_per_key=2))
    a1 = mgr.submit(SMOKE, CPU1, owner="alice")  # never ticked: everything stays queued
    mgr.submit(SMOKE, CPU1, owner="alice")
    assert a1.owner == "alice" and mgr.get(a1.id).owner == "alice"
    e = _refused(lambda: mgr.submit(SMOKE, CPU1, owner="alice"))
    assert (e.status, e.detail) == (429, "key alice has 2 jobs queued, its limit is 2 "
                                         "(VIT_SERVICE_JOBS_MAX_QUEUED_PER_KEY); retry when "
                                         "one of them has started")
    b1 = mgr.submit(SMOKE, CPU1, owner="bob")  # bob's count is his own
    assert b1.owner == "bob"
    mgr.submit(SMOKE, CPU1, owner="bob")
    e = _refused(lambda: mgr.submit(SMOKE, CPU1, owner="carol"))
    assert e.status == 429 and e.detail.startswith(
        "the job queue is full (4 queued, the limit is 4: VIT_SERVICE_JOBS_MAX_QUEUED)")
    # a resume is queued like a submit: it counts against its owner's cap
    mgr.cancel(a1.id)
    mgr.cancel(b1.id)
    mgr.submit(SMOKE, CPU1, owner="alice")
    e = _refused(lambda: mgr.resume(a1.id))
    assert e.status == 429 and e.detail.startswith("key alice has 2 jobs queued")
    assert mgr.get(a1.id).state == JobState.cancelled
    assert mgr.submit(SMOKE, CPU1).owner == "default"  # VIT_SERVICE_API_KEY's principal


def test_a_resume_is_checked_against_the_limits_of_the_server_as_it_is_now(
        tmp_path: Path) -> None:
    """A job submitted under one server's limits and resumed under lower ones (an operator
    lowered them, or the row is an older release's) is refused and stays as it was."""
    mgr = _manager(_settings(tmp_path, jobs_max_epochs=5, jobs_max_procs=2))
    job = mgr.submit(SMOKE, {**CPU1, "epochs": 4}, nprocs=2)
    mgr.cancel(job.id)
    for lower, detail in (
            ({"jobs_max_epochs": 3}, "override 'epochs': 4 is over this server's limit of 3"),
            ({"jobs_max_procs": 1}, "nprocs must be between 1 and 1")):
        strict = _manager(_settings(tmp_path, **({"jobs_max_epochs": 5, "jobs_max_procs": 2}
                                                  | lower)))
        e = _refused(lambda m=strict: m.resume(job.id))
        assert (e.status, e.detail) == (422, detail)
        assert strict.get(job.id).state == JobState.cancelled
    # not today's recipe file: a resume from a checkpoint runs the recipe saved in it
    def _recipe_changed(recipe: str, overrides: dict[str, Any]) -> None:
        raise JobError(422, f"{recipe} no longer takes these overrides")

    settings = _settings(tmp_path, jobs_max_epochs=5, jobs_max_procs=2)
    changed = JobManager(settings, executor=LocalExecutor(settings, command=_command),
                         validate=_recipe_changed)
    assert _refused(lambda: changed.submit(SMOKE, CPU1)).status == 422
    assert changed.resume(job.id).state == JobState.queued


def test_running_caps_skip_to_the_next_eligible_job_in_priority_order(
        tmp_path: Path, managers: list[JobManager]) -> None:
    mgr = _manager(_settings(tmp_path, jobs_max_running_per_key=1, jobs_max_running=2))
    managers.append(mgr)
    a1 = mgr.submit(SMOKE, CPU1, name="a1", owner="alice", priority=5)
    a2 = mgr.submit(SMOKE, CPU1, name="a2", owner="alice", priority=5)
    b1 = mgr.submit(SMOKE, CPU1, name="b1", owner="bob")
    b2 = mgr.submit(SMOKE, CPU1, name="b2", owner="bob")
    c1 = mgr.submit(SMOKE, CPU1, name="c1", owner="carol")
    mgr.tick()
    state = {j.name: j for j in mgr.list()}
    assert [n for n in ("a1", "a2", "b1", "b2", "c1") if state[n].state == JobState.running] \
        == ["a1", "b1"]
    assert state["a2"].queue_position == 1  # first in line, skipped for its key's cap
    assert state["a2"].waiting_for == "the running cap of key alice: 1 of 1 running"
    assert state["b2"].waiting_for == "the running cap of key bob: 1 of 1 running"
    assert state["c1"].waiting_for == "the global running cap: 2 of 2 running"

    _release(mgr, a1)  # alice's slot frees: her next job starts, ahead of carol's
    _until(mgr, lambda: mgr.get(a2.id).state == JobState.running)
    assert mgr.get(c1.id).waiting_for == "the global running cap: 2 of 2 running"
    _release(mgr, b1, a2)
    _until(mgr, lambda: {mgr.get(j.id).state for j in (b2, c1)} == {JobState.running})
    _release(mgr, b2, c1)


def test_jobs_start_when_their_cpus_and_gpus_are_free_in_strict_order(
        tmp_path: Path, managers: list[JobManager]) -> None:
    """A machine of 4 CPUs and 2 GPUs: a 2-GPU job runs; a 1-GPU job waits for a GPU, and the
    CPU job behind it waits behind it (strict order), although its CPUs are free."""
    mgr = _manager(_settings(tmp_path, jobs_gpus=2))
    managers.append(mgr)
    big = mgr.submit(SMOKE, GPU1, name="big", nprocs=2)
    one = mgr.submit(SMOKE, GPU1, name="one")
    cpu = mgr.submit(SMOKE, {"device": "cpu", "threads": 2}, name="cpu")
    every = mgr.submit(SMOKE, {"device": "cpu", "threads": None}, name="every")  # all cores
    assert mgr.executor.needs(big) == {"GPU": 2, "CPU": 2}
    auto = mgr.submit(SMOKE, {"device": "auto"}, name="auto")
    assert mgr.executor.needs(auto) == {"GPU": 1, "CPU": 1}  # auto: a GPU where there is one
    mgr.cancel(auto.id)
    assert mgr.executor.needs(every) == {"CPU": 4}
    e = _refused(lambda: mgr.submit(SMOKE, GPU1, nprocs=3))
    assert e.status == 422 and e.detail.startswith(
        "this job needs 3 GPUs (this machine has 2): it could never start here")

    mgr.tick()
    assert mgr.get(big.id).state == JobState.running
    assert mgr.get(one.id).waiting_for == "1 GPU (0 of 2 free)"
    assert mgr.get(cpu.id).waiting_for == "1 job ahead in the queue"
    assert mgr.get(every.id).waiting_for == "2 jobs ahead in the queue"

    _release(mgr, big)
    _until(mgr, lambda: {mgr.get(j.id).state for j in (one, cpu)} == {JobState.running})
    assert mgr.get(every.id).waiting_for == "4 CPUs (1 of 4 free)"  # one: 1, cpu: 2

    # a queued job cancelled while it waits is never launched: no process, no run folder
    cancelled = mgr.cancel(every.id)
    assert cancelled.state == JobState.cancelled
    _release(mgr, one, cpu)
    for _ in range(5):
        mgr.tick()
    gone = mgr.get(every.id)
    assert (gone.state, gone.started_at, gone.attempts, gone.pid) == \
        (JobState.cancelled, None, 0, None)
    assert every.id not in mgr.executor.procs and not Path(every.run_dir).exists()


def test_resource_admission_can_be_switched_off(tmp_path: Path,
                                                managers: list[JobManager]) -> None:
    """jobs_admit_by_resources=false: slots alone, as before admission read resources."""
    mgr = _manager(_settings(tmp_path, jobs_cpus=1, jobs_admit_by_resources=False))
    managers.append(mgr)
    jobs = [mgr.submit(SMOKE, {"device": "cpu", "threads": 1}) for _ in range(2)]
    _until(mgr, lambda: all(mgr.get(j.id).state == JobState.running for j in jobs))
    _release(mgr, *jobs)


# --- principals through the real app ----------------------------------------------------------
KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-01234567890"}
DEFAULT_KEY = "default-key-0123456789"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_each_key_is_a_principal_that_owns_its_jobs(tmp_path: Path) -> None:
    """Two named keys and the default one, on the real app: the job records who submitted
    it, the per-key queued cap counts each key alone, and a wrong key is 401."""
    from serving.app import create_app

    settings = _settings(tmp_path, api_key=DEFAULT_KEY, api_keys=KEYS, jobs_concurrency=1,
                         jobs_max_queued_per_key=1, reload_interval_s=0, discover_models=0,
                         tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    app = create_app(settings.model_copy(update={"models": {}}))
    app.state.jobs = _manager(app.state.settings)
    body = {"recipe": SMOKE, "overrides": CPU1}
    with TestClient(app) as c:
        first = c.post("/v1/jobs", json=body, headers=_auth(KEYS["alice"]))
        assert first.status_code == 202 and first.json()["owner"] == "alice"
        mgr: JobManager = app.state.jobs
        _until(mgr, lambda: mgr.get(first.json()["id"]).state == JobState.running)
        second = c.post("/v1/jobs", json=body, headers=_auth(KEYS["alice"]))
        assert second.status_code == 202, second.text
        assert second.json()["waiting_for"] == "a free slot: 1 of 1 running (local)"
        refused = c.post("/v1/jobs", json=body, headers=_auth(KEYS["alice"]))
        assert refused.status_code == 429
        assert refused.json()["detail"].startswith("key alice has 1 jobs queued, its limit "
                                                   "is 1 (VIT_SERVICE_JOBS_MAX_QUEUED_PER_KEY)")
        bobs = c.post("/v1/jobs", json=body, headers=_auth(KEYS["bob"]))  # his own count
        assert bobs.status_code == 202 and bobs.json()["owner"] == "bob"
        dflt = c.post("/v1/jobs", json=body, headers=_auth(DEFAULT_KEY))
        assert dflt.json()["owner"] == "default"
        listed = c.get("/v1/jobs?state=queued", headers=_auth(KEYS["bob"])).json()["jobs"]
        assert {j["owner"] for j in listed} == {"alice", "bob", "default"}
        assert c.post("/v1/jobs", json=body, headers=_auth("x" * 20)).status_code == 401
        assert c.get("/v1/info").json()["api_key_configured"] is True
        assert "<th>owner</th>" in c.get("/").text
        for job in mgr.list():  # nothing left running past the test
            if job.state == JobState.queued:
                mgr.cancel(job.id)
        (Path(mgr.get(first.json()["id"]).run_dir) / "release").touch()
        _until(mgr, lambda: mgr.get(first.json()["id"]).state == JobState.succeeded)


@pytest.mark.parametrize("keys, env_key, needle", [
    ({"alice": "short"}, None, "at least 16 characters"),
    ({"alice": "same-key-0123456789", "bob": "same-key-0123456789"}, None, "its own"),
    ({"default": "alice-key-0123456789"}, DEFAULT_KEY, "VIT_SERVICE_API_KEY's principal"),
    ({"alice": DEFAULT_KEY}, DEFAULT_KEY, "also in VIT_SERVICE_API_KEYS"),
    ({"al ice": "alice-key-0123456789"}, None, "API key name"),
], ids=["short", "shared", "default-named", "default-repeated", "bad-name"])
def test_named_keys_are_checked_at_start_up(keys: dict, env_key: str | None,
                                            needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Settings(api_keys=keys, api_key=env_key)


# --- a Ray cluster's resources ------------------------------------------------------------------
def test_on_ray_jobs_wait_for_free_cpus_read_from_the_head(tmp_path: Path, ray_head) -> None:
    """The head's own report over HTTP (GET /api/cluster_status): the session's head node has
    2 CPUs (other tests may have joined 1-CPU nodes). Work the service does not know (a Ray
    job submitted directly) holds 1.5 of them: a job asking 2 waits for it to end; 3 workers
    of 2 CPUs, more than the nodes have room for, wait for the cluster to grow rather than
    being refused. Nothing is launched (the scheduler never runs)."""
    from ray.job_submission import JobSubmissionClient

    from serving.jobs.ray_jobs import RayExecutor

    s = _settings(tmp_path, jobs_executor="ray", ray_address=ray_head.address,
                  ray_cpus_per_proc=2)
    mgr = JobManager(s, executor=RayExecutor(s), validate=_validate)
    client = JobSubmissionClient(ray_head.address)
    other = client.submit_job(entrypoint="sleep 60", entrypoint_num_cpus=1.5)  # on the head
    try:
        deadline = time.monotonic() + 30
        while not (cap := mgr.executor.capacity()).nodes:  # a new head: no report yet
            assert time.monotonic() < deadline, "the Ray head gave no resource report"
            time.sleep(0.5)
        assert max(n.total["CPU"] for n in cap.nodes) == 2 and cap.total["GPU"] == 0
        assert cap.elastic
        room = sum(int(n.total["CPU"] // 2) for n in cap.nodes)
        big = mgr.submit(SMOKE, CPU1, nprocs=3)  # 3 Ray Train workers of 2 CPUs each
        assert big.waiting_for == (f"3 workers of 2 CPUs on the Ray cluster (room for {room} "
                                   "in all): waiting for the cluster to grow")
        small = mgr.submit(SMOKE, CPU1)
        _poll(lambda: (mgr.get(small.id).waiting_for or "").startswith("2 CPUs on "), True)
        if len(cap.nodes) == 1:
            assert mgr.get(small.id).waiting_for == "2 CPUs on the Ray cluster (0.5 free)"
    finally:
        client.stop_job(other)
    _poll(lambda: mgr.get(small.id).waiting_for, "the scheduler's next pass")
    assert mgr.get(big.id).state == JobState.queued
    for job in (small, big):
        mgr.cancel(job.id)


def test_a_clusters_nodes_place_whole_processes_or_workers() -> None:
    """Two nodes of one GPU each: a 2-GPU process fits on neither (it waits for a bigger node);
    two 1-GPU workers fit, one on each, and then nothing else does."""
    cluster = Capacity([Node({"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1}) for _ in range(2)],
                       cluster="the Ray cluster", elastic=True).held({})
    need = {"CPU": 2, "GPU": 2}
    assert cluster.too_big(need) == ("2 GPUs on one node of the Ray cluster (the largest has "
                                     "1) and 2 CPUs on one node of the Ray cluster (the "
                                     "largest has 4): waiting for the cluster to grow")
    workers = Shape(bundles=2)
    assert cluster.too_big(need, workers) is None and cluster.shortfall(need, workers) is None
    assert cluster.too_big(need, Shape(bundles=2, per_node=1)) is None
    cluster.take(need, workers)
    assert [n.free for n in cluster.nodes] == [{"CPU": 3, "GPU": 0}] * 2
    assert cluster.shortfall({"CPU": 1, "GPU": 1}) == "1 GPU on the Ray cluster (0 free)"
    assert cluster.shortfall({"CPU": 6}, Shape(bundles=3)) == \
        "3 workers of 2 CPUs on the Ray cluster (room for 2 now)"  # 6 free, but 3 + 3
    assert cluster.shortfall({"CPU": 8}, Shape(bundles=2)) == \
        "8 CPUs on the Ray cluster (6 free)"


def _poll(read: Callable[[], Any], want: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := read()) != want:
        assert time.monotonic() < deadline, f"{got!r} != {want!r}"
        time.sleep(0.3)


def test_a_job_request_with_no_text_in_it_is_a_422_and_nothing_is_stored(tmp_path: Path) -> None:
    """Lone surrogates (JSON "\\ud800" escapes) in an override value, an override key or a
    path: each a 422 whose detail is printable JSON, none stored, the listing still a 200."""
    from serving.app import create_app

    settings = _settings(tmp_path, api_key=DEFAULT_KEY, reload_interval_s=0, discover_models=0,
                         tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    app = create_app(settings.model_copy(update={"models": {}}))
    app.state.jobs = _manager(app.state.settings)
    headers = {"content-type": "application/json", **_auth(DEFAULT_KEY)}
    bodies = [b'{"recipe": "%s", "overrides": {"description": "x \\ud800"}}',
              b'{"recipe": "%s", "overrides": {"augment.\\udc00": 1}}',
              b'{"recipe": "%s", "overrides": {"data.path": "\\ud800"}}']
    with TestClient(app) as c:
        for body in bodies:
            r = c.post("/v1/jobs", content=body % SMOKE.encode(), headers=headers)
            assert r.status_code == 422 and "not valid Unicode" in r.json()["detail"], r.text
        listed = c.get("/v1/jobs", headers=_auth(DEFAULT_KEY))
        assert listed.status_code == 200 and listed.json()["jobs"] == []
