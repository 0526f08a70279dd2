"""Jobs that span several Ray nodes: Ray Train workers placed across a real two-node cluster
(the session's head plus a second raylet joined with ``ray start --address``), and what happens
when a node dies mid-run. Through the job manager with the Ray executor, as ``/v1/jobs`` runs
them; the timelines these tests print are docs/jobs.md's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.jobs import JobManager, JobState, create_job_manager
from serving.jobs.progress import cluster_timeline
from tests.serving.jobs.ray_head import RayHead
from vit_service.config import Settings

OVERRIDES = {"threads": 1, "attention_samples": 0, "device": "cpu"}


@pytest.fixture(scope="module")
def two_nodes(ray_head: RayHead) -> Iterator[RayHead]:
    """The session's head (2 CPUs) plus node ``nodeb`` (1 CPU)."""
    if "nodeb" not in ray_head.alive_resources():
        ray_head.add_node("nodeb")
    yield ray_head


def _manager(tmp_path: Path, head: RayHead, **kw) -> JobManager:
    from tests.training.conftest import make_cifar_archive

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    if not (data / "cifar10-jpeg-train.tar.gz").exists():
        make_cifar_archive(data / "cifar10-jpeg-train.tar.gz", per_class=30)
    home = tmp_path / "home"
    uri = f"sqlite:///{home / 'mlflow.db'}"
    # STRICT_SPREAD: one worker per node, so the two workers must use both nodes
    return create_job_manager(Settings(
        home=home, data_dir=data, jobs_executor="ray", ray_address=head.address,
        ray_placement="STRICT_SPREAD", ray_storage_path=str(tmp_path / "ray-storage"),
        cache_dir=tmp_path / "cache", **kw, **{"MLFLOW_TRACKING_URI": uri}))


def _tick_until(mgr: JobManager, job_id: str, done, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    job = mgr.get(job_id)
    while time.monotonic() < deadline and not done(job):
        mgr.tick()
        job = mgr.get(job_id)
        if not done(job):
            time.sleep(0.5)
    return job


def _show(title: str, t0: float, events: list[dict]) -> list[str]:
    """The timeline as docs/jobs.md prints it: seconds since the submit, phase, where."""
    lines = [title]
    ckpts = [e for e in events if e["phase"] == "checkpoint"]
    shown: set[int] = set()  # of the checkpoints, each attempt's first and last
    for attempt in {e.get("attempt") for e in ckpts}:
        mine = [e for e in ckpts if e.get("attempt") == attempt]
        shown |= {id(mine[0]), id(mine[-1])}
    for e in events:
        if e["phase"] == "checkpoint" and id(e) not in shown:
            continue
        where = (f"rank {e['rank']}" if "rank" in e else "driver") + (
            f" on node {str(e['node_id'])[:8]}" if e.get("node_id") else "")
        extra = f" step {e['at_step']}" if "at_step" in e else ""
        lines.append(f"  +{float(e['time']) - t0:6.1f}s  attempt {e.get('attempt', '-')}  "
                     f"{e['phase']:<10} {where}{extra}")
    print("\n".join(lines))
    return lines


def _phase(events: list[dict], phase: str, **match) -> list[dict]:
    return [e for e in events if e["phase"] == phase
            and all(e.get(k) == v for k, v in match.items())]


def test_a_two_worker_job_runs_one_worker_on_each_node(tmp_path: Path,
                                                       two_nodes: RayHead) -> None:
    """nprocs=2 on Ray: a Ray Train driver, two workers on two different nodes, world size 2,
    checkpoints in Ray's storage; both node ids on the MLflow run."""
    from tests.training.conftest import mlflow_client

    mgr = _manager(tmp_path, two_nodes)
    t0 = time.time()
    job = mgr.submit("cifar10-smoke", {**OVERRIDES, "epochs": 2}, nprocs=2)
    job = _tick_until(mgr, job.id, lambda j: j.state.finished, 240)
    log = "\n".join(mgr.logs(job.id, tail=400))
    assert job.state == JobState.succeeded, f"{job.state}: {job.reason}\n{log[-4000:]}"
    assert "-m training.ray_train cifar10-smoke" in log

    cluster = job.progress["cluster"]
    assert cluster["nodes"] == 2 and len(cluster["workers"]) == 2, cluster
    assert cluster["attempt"] == 1 and cluster["checkpoint_step"] == 12, cluster
    run = mlflow_client(mgr.settings.resolved_tracking_uri).get_run(job.mlflow_run_id)
    assert run.data.params["train.world_size"] == "2"
    tags = run.data.tags
    assert tags["vit_service.ray.nodes"] == "2", tags
    node_ids = tags["vit_service.ray.node_ids"].split(",")
    assert len(set(node_ids)) == 2
    assert {w["node_id"] for w in cluster["workers"].values()} == set(node_ids)
    assert list(Path(mgr.executor.storage_path(), f"job-{job.id}").glob("checkpoint_*"))

    events = cluster_timeline(job.log_path)
    _show(f"two-node job {job.id}", t0, events)
    ready = {e["rank"]: e for e in _phase(events, "ready")}
    first = {e["rank"]: e for e in _phase(events, "first_step")}
    assert set(ready) == set(first) == {0, 1}
    submitted, finished = _phase(events, "submitted")[0], _phase(events, "finished")[0]
    checkpoints = _phase(events, "checkpoint")
    assert [e["at_step"] for e in checkpoints] == [6, 12]
    assert submitted["time"] <= min(e["time"] for e in ready.values())
    assert max(e["time"] for e in ready.values()) <= min(e["time"] for e in first.values())
    assert max(e["time"] for e in first.values()) <= checkpoints[0]["time"] <= finished["time"]


def test_a_dead_node_restarts_the_job_from_its_last_checkpoint(tmp_path: Path,
                                                               two_nodes: RayHead) -> None:
    """A node's raylet is SIGKILLed mid-run: Ray Train notices, waits for room for the group
    again (a replacement node joins, as an autoscaler's would) and restarts both workers from
    the last checkpoint in Ray's storage; the job succeeds as the same MLflow run."""
    from tests.training.conftest import mlflow_client

    mgr = _manager(tmp_path, two_nodes, ray_max_failures=1)
    t0 = time.time()
    job = mgr.submit("cifar10-smoke", {**OVERRIDES, "epochs": 16}, nprocs=2)
    job = _tick_until(mgr, job.id, lambda j: j.state.finished or int(
        j.progress.get("cluster", {}).get("checkpoint_step") or 0) >= 12, 240)
    assert job.state == JobState.running, f"{job.state}: {job.reason}"
    killed_at = time.time()
    victim = next(w["node_id"] for w in job.progress["cluster"]["workers"].values()
                  if w["node_id"] != _head_node_id(two_nodes))
    two_nodes.kill_node("nodeb")
    two_nodes.add_node("nodec")  # the replacement the group waits for (STRICT_SPREAD)
    job = _tick_until(mgr, job.id, lambda j: j.state.finished, 300)
    log = "\n".join(mgr.logs(job.id, tail=300))
    assert job.state == JobState.succeeded, f"{job.state}: {job.reason}\n{log[-4000:]}"

    events = cluster_timeline(job.log_path)
    lines = _show(f"node-kill job {job.id} (node {victim[:8]} killed at "
                  f"+{killed_at - t0:.1f}s)", t0, events)
    assert job.progress["cluster"]["attempt"] == 2, job.progress["cluster"]
    restored = _phase(events, "restored", attempt=2)
    assert {e["rank"] for e in restored} == {0, 1}, lines
    second = _phase(events, "ready", attempt=2)
    assert victim not in {e["node_id"] for e in second} and len(
        {e["node_id"] for e in second}) == 2
    # the restart resumed from a checkpoint of attempt 1 (the latest Ray had registered when
    # the node died: a report still on its way to the controller is lost with the node)
    saved = {e["at_step"] for e in _phase(events, "checkpoint", attempt=1)}
    assert {e["at_step"] for e in restored} <= saved and min(saved) > 0, lines
    from_step = restored[0]["at_step"]
    resumed_at = min(e["at_step"] for e in _phase(events, "first_step", attempt=2))
    assert from_step < resumed_at <= from_step + 6, lines  # its first logged step
    run = mlflow_client(mgr.settings.resolved_tracking_uri).get_run(job.mlflow_run_id)
    assert run.data.tags["vit_service.ray.attempt"] == "2"
    assert victim not in run.data.tags["vit_service.ray.node_ids"]
    assert job.progress["step"] == 96


def _head_node_id(head: RayHead) -> str:
    import httpx

    for node in httpx.get(f"{head.address}/nodes?view=summary", timeout=10).json()[
            "data"]["summary"]:
        raylet = node.get("raylet", {})
        if raylet.get("state") == "ALIVE" and raylet.get("isHeadNode"):
            return raylet["nodeId"]
    raise AssertionError("no head node")


def test_a_cancelled_two_worker_job_checkpoints_and_resumes_through_the_api(
        tmp_path: Path, two_nodes: RayHead) -> None:
    """Cancel reaches the workers through their driver: they stop after the current step with
    a checkpoint in Ray's storage (not a restart: a cancel is no failure); the job is
    cancelled, and its resume continues from that checkpoint to the end."""
    mgr = _manager(tmp_path, two_nodes)
    job = mgr.submit("cifar10-smoke", {**OVERRIDES, "epochs": 12}, nprocs=2)
    job = _tick_until(mgr, job.id, lambda j: j.state.finished or int(
        j.progress.get("cluster", {}).get("checkpoint_step") or 0) >= 6, 240)
    assert job.state == JobState.running, f"{job.state}: {job.reason}"
    mgr.cancel(job.id)
    job = _tick_until(mgr, job.id, lambda j: j.state.finished, 120)
    log = "\n".join(mgr.logs(job.id, tail=300))
    assert job.state == JobState.cancelled, f"{job.state}: {job.reason}\n{log[-3000:]}"
    events = cluster_timeline(job.log_path)
    stopped = _phase(events, "stopped")
    assert {e.get("rank") for e in stopped} >= {0, 1}, log[-6000:]  # both stopped cleanly
    stop_step = max(e["at_step"] for e in stopped if "rank" in e)
    assert 6 <= stop_step < 72
    assert not _phase(events, "ready", attempt=2)  # no restart

    job = mgr.resume(job.id)
    job = _tick_until(mgr, job.id, lambda j: j.state.finished, 240)
    log = "\n".join(mgr.logs(job.id, tail=300))
    assert job.state == JobState.succeeded, f"{job.state}: {job.reason}\n{log[-3000:]}"
    events = cluster_timeline(job.log_path)
    restored = _phase(events, "restored")
    assert {e["rank"] for e in restored} == {0, 1}
    assert {e["at_step"] for e in restored} == {stop_step}  # the stop's own checkpoint
    resumed_at = min(e["at_step"] for e in _phase(events, "first_step")
                     if e["time"] > stopped[-1]["time"])
    assert stop_step < resumed_at <= stop_step + 6
    assert job.progress["step"] == 72 and job.attempts == 2
