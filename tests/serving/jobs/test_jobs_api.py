"""The jobs API end to end, for both executors: a real `vit-service serve` process, real
`vit-service train` jobs (smoke recipe on a generated CIFAR-10 archive), a real SQLite jobs
database and MLflow; with ``executor=ray`` the jobs go to a real single-node Ray cluster on
loopback (one head for the whole session, tests/serving/jobs/ray_head.py)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving.procs import Server, jobs_env
from tests.training.conftest import mlflow_client


@pytest.fixture(scope="module", params=["local", "ray"])
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    executor = request.param
    root = tmp_path_factory.mktemp(f"jobs-e2e-{executor}")
    env = jobs_env(root, VIT_SERVICE_JOBS_CANCEL_GRACE_S="60",
                   VIT_SERVICE_MLFLOW_UI_URL="http://mlflow.example:5000")
    home = root / "home"
    if executor == "ray":
        head = request.getfixturevalue("ray_head")
        # VIT_SERVICE_RAY_PYTHON unset: a head on this machine runs jobs with the API's own
        # interpreter (the head itself was started without the venv on PATH)
        env.update({"VIT_SERVICE_JOBS_EXECUTOR": "ray", "VIT_SERVICE_RAY_ADDRESS": head.address})
    s = Server(env, home)
    s.executor = executor  # type: ignore[attr-defined]
    s.start()
    yield s
    s.stop()


def _follow(server: Server, job_id: str, until: set[str], timeout: float = 240,
            pred=None) -> dict:
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = server.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in until and (pred is None or pred(job)):
            return job
        if job["state"] in {"succeeded", "failed", "cancelled"} - until:
            logs = server.get(f"/v1/jobs/{job_id}/logs?tail=40").json()["lines"]
            raise AssertionError(f"job ended {job['state']}: {job['reason']}\n" + "\n".join(logs))
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} stuck in {job.get('state')}: {job}")


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_auth_is_required(server: Server) -> None:
    r = httpx.get(server.url + "/v1/jobs")
    assert r.status_code == 401
    r = httpx.get(server.url + "/v1/jobs", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(server.url + "/v1/jobs", json={"recipe": "cifar10-smoke"})
    assert r.status_code == 401


@pytest.mark.parametrize("body, needle", [
    ({"recipe": "no-such-recipe"}, "unknown recipe"),
    ({"recipe": "../../etc/passwd"}, "unknown recipe"),
    ({"recipe": "cifar10-smoke", "overrides": {"epochz": 2}}, "epochz"),
    ({"recipe": "cifar10-smoke", "overrides": {"epochs": "many"}}, "epochs"),
    ({"recipe": "cifar10-smoke", "overrides": {"model.pos_encoding": "spiral"}}, "pos_encoding"),
    ({"recipe": "cifar10-smoke", "command": "rm -rf /"}, "command"),
    ({"recipe": "cifar10-smoke", "priority": 11}, "priority"),
    ({"recipe": "cifar10-smoke", "priority": True}, "priority"),  # no coercion to 1
    ({"recipe": "cifar10-smoke", "nprocs": "2"}, "nprocs"),
    ({"recipe": "cifar10-smoke", "overrides": {"epochs": True}}, "expected an integer"),
    ({"recipe": "cifar10-smoke", "overrides": {"augment.hflip": 1}}, "expected true or false"),
    ({"recipe": "cifar10-smoke", "overrides": {"data.data_dir": "/etc"}}, ""),
    ({"recipe": "cifar10-smoke", "overrides": {"augment.resolution_schedule": "[[0.5, 12]]"}},
     "multiple of the patch size"),
])
def test_invalid_jobs_are_422(server: Server, body: dict, needle: str) -> None:
    r = server.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.text


def test_submit_and_follow_to_success(server: Server) -> None:
    recipes = server.get("/v1/recipes").json()["recipes"]
    assert "cifar10-smoke" in {r["name"] for r in recipes}
    r = server.post("/v1/jobs", json={"recipe": "cifar10-smoke", "name": "smoke",
                                      "overrides": {"epochs": 1, "model.pos_encoding": "learned"}})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] == "queued" and job["name"] == "smoke"
    t0 = time.monotonic()
    first_step = _follow(server, job["id"], {"running", "succeeded"},
                         pred=lambda j: (j["progress"].get("step") or 0) > 0)
    t_step = time.monotonic() - t0
    done = _follow(server, job["id"], {"succeeded"})
    print(f"\n[{server.executor}] job timeline: submitted -> claimed "
          f"{(_ts(done['started_at']) - _ts(done['created_at'])):.1f} s -> first step seen "
          f"{t_step:.1f} s -> succeeded {(_ts(done['finished_at']) - _ts(done['created_at'])):.1f}"
          f" s (state at first step: {first_step['state']})")
    assert done["exit_code"] == 0 and done["started_at"] and done["finished_at"]
    assert done["mlflow_run_id"] and done["executor"] == server.executor
    uri = server.env["MLFLOW_TRACKING_URI"]
    versions = mlflow_client(uri).search_model_versions(f"run_id='{done['mlflow_run_id']}'")
    assert [v.name for v in versions] == ["cifar10-vit"]  # the recipe's register_as
    assert done["mlflow_run_url"].endswith(f"/#/runs/{done['mlflow_run_id']}")
    assert "val_acc" in done["progress"]["metrics"]
    assert done["progress"]["total_steps"] == done["progress"]["step"]
    logs = server.get(f"/v1/jobs/{job['id']}/logs?tail=5").json()["lines"]
    assert len(logs) <= 5 and logs
    listed = server.get("/v1/jobs?state=succeeded").json()["jobs"]
    assert job["id"] in {j["id"] for j in listed}

    # the metric series match the job's progress log, point for point
    lines = server.get(f"/v1/jobs/{job['id']}/logs?tail=10000").json()["lines"]
    events = [json.loads(ln) for ln in lines if ln.startswith('{"event"')]
    steps = [e for e in events if e["event"] == "step"]
    m = server.get(f"/v1/jobs/{job['id']}/metrics").json()
    assert m["series"]["loss"] == [[e["step"], e["loss"]] for e in steps]
    assert m["series"]["lr"] == [[e["step"], e["lr"]] for e in steps]
    assert m["series"]["val_acc"][-1] == [done["progress"]["step"],
                                          done["progress"]["metrics"]["val_acc"]]
    assert m["eta_s"] == 0 and m["step"] == m["total_steps"] == done["progress"]["step"]
    assert m["points"] == sum(len(v) for v in m["series"].values()) and not m["downsampled"]
    small = server.get(f"/v1/jobs/{job['id']}/metrics?max_points=2").json()
    assert all(len(v) <= 2 for v in small["series"].values())
    assert small["downsampled"] == any(len(v) > 2 for v in m["series"].values())
    assert small["series"]["loss"][-1] == m["series"]["loss"][-1]
    assert server.get("/v1/jobs/nope/metrics").status_code == 404
    assert server.get(f"/v1/jobs/{job['id']}/metrics?max_points=1").status_code == 422
    assert httpx.get(server.url + f"/v1/jobs/{job['id']}/metrics").status_code == 401


def test_cancel_leaves_a_checkpoint_and_resume_continues(server: Server) -> None:
    r = server.post("/v1/jobs", json={"recipe": "cifar10-smoke", "overrides": {"epochs": 400}})
    job = r.json()
    running = _follow(server, job["id"], {"running"},
                      pred=lambda j: (j["progress"].get("step") or 0) >= 8)
    assert running["state"] == "running"
    r = server.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202
    done = _follow(server, job["id"], {"cancelled"}, timeout=90)
    assert done["reason"].startswith("cancelled")
    run_dir = Path(server.home) / "runs" / f"job-{job['id']}"
    ckpts = list(run_dir.rglob("*.pt"))
    assert ckpts, f"no checkpoint under {run_dir}"
    step_at_cancel = done["progress"]["step"]

    r = server.post(f"/v1/jobs/{job['id']}/resume")
    assert r.status_code == 202 and r.json()["state"] == "queued"
    again = _follow(server, job["id"], {"running"},
                    pred=lambda j: (j["progress"].get("step") or 0) > step_at_cancel)
    assert again["attempts"] == 2
    logs = "\n".join(server.get(f"/v1/jobs/{job['id']}/logs?tail=400").json()["lines"])
    assert ("--resume auto" if server.executor == "local" else "--resume if-exists") in logs
    starts = [json.loads(ln) for ln in logs.splitlines() if ln.startswith('{"event": "start"')]
    assert starts and starts[-1]["step"] >= step_at_cancel  # continued from the checkpoint
    server.post(f"/v1/jobs/{job['id']}/cancel")
    _follow(server, job["id"], {"cancelled"}, timeout=90)
    r = server.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 409


def test_restart_mid_job_keeps_the_record(server: Server) -> None:
    r = server.post("/v1/jobs", json={"recipe": "cifar10-smoke", "overrides": {"epochs": 3}})
    job = r.json()
    _follow(server, job["id"], {"running"}, pred=lambda j: (j["progress"].get("step") or 0) >= 1)
    server.stop(signal.SIGKILL)  # the API dies hard; the job's own process goes on
    server.start()
    rec = server.get(f"/v1/jobs/{job['id']}").json()
    assert rec["state"] in {"running", "succeeded"}
    done = _follow(server, job["id"], {"succeeded"})
    assert done["progress"]["step"] == done["progress"]["total_steps"]


def test_two_api_processes_start_each_job_once(server: Server) -> None:
    """A second API process on the same jobs database and home: every queued job is claimed
    by exactly one scheduler (one attempt, one launch line in its log)."""
    other = Server(server.env, server.home)
    other.start()
    try:
        ids = [server.post("/v1/jobs", json={"recipe": "cifar10-smoke", "overrides": {
            "epochs": 1, "data.subset": 96, "attention_samples": 0}}).json()["id"]
            for _ in range(3)]
        for job_id in ids:
            done = _follow(other, job_id, {"succeeded"})
            assert done["attempts"] == 1, done
            log = (Path(server.home) / "runs" / f"job-{job_id}" / "job.log").read_text()
            launches = [ln for ln in log.splitlines() if ln.startswith("# ")]
            assert len(launches) == 1, launches
    finally:
        other.stop()
