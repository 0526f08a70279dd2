"""The job manager with its Ray executor against a real Ray head (the session's,
tests/serving/jobs/ray_head.py) and against an address where nothing answers. The full submit /
cancel / resume / restart scenarios through the API run in test_jobs_api.py with
``executor=ray``."""

from __future__ import annotations

import shlex
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from serving.jobs import JobError, JobManager, JobState, create_job_manager
from serving.jobs.local import LocalExecutor
from serving.jobs.ray_jobs import LOST, RayExecutor
from serving.jobs.store import utcnow
from tests.serving.jobs.ray_head import RayHead
from vit_service.config import Settings


def _dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _settings(tmp_path: Path, address: str, **kw) -> Settings:
    return Settings(home=tmp_path / "home", data_dir=tmp_path / "data", jobs_executor="ray",
                    ray_address=address, ray_timeout_s=5, **kw)


def _follow(mgr: JobManager, job_id: str, timeout_s: float):
    """Tick the manager until the job has finished (or ``timeout_s`` passed); the job."""
    deadline = time.monotonic() + timeout_s
    job = mgr.get(job_id)
    while time.monotonic() < deadline and not job.state.finished:
        mgr.tick()
        job = mgr.get(job_id)
        if not job.state.finished:
            time.sleep(0.5)
    return job


def test_the_executor_setting_picks_the_manager(tmp_path: Path) -> None:
    local = create_job_manager(Settings(home=tmp_path))
    assert type(local).__name__ == "JobManager" and isinstance(local.executor, LocalExecutor)
    assert isinstance(create_job_manager(_settings(tmp_path, _dead_address())).executor,
                      RayExecutor)


def test_unreachable_ray_is_503_and_loses_nothing(tmp_path: Path) -> None:
    mgr = create_job_manager(_settings(tmp_path, _dead_address()))
    kept = mgr.store.create(name="kept", recipe="cifar10-smoke", overrides={}, nprocs=1,
                            runs_root=mgr.runs_root)
    mgr.store.update(kept.id, state=JobState.running, executor="ray", started_at=utcnow())
    with pytest.raises(JobError) as e:
        mgr.submit("cifar10-smoke", {"epochs": 1})
    assert e.value.status == 503 and "unreachable" in str(e.value.detail)
    with pytest.raises(JobError) as e:
        mgr.submit("no-such-recipe", {})  # a bad config is still a 422 first
    assert e.value.status == 422
    with pytest.raises(JobError) as e:
        mgr.cancel(kept.id)
    assert e.value.status == 503
    mgr.tick()  # a pass with the head away changes nothing
    assert [j.id for j in mgr.list()] == [kept.id]
    after = mgr.get(kept.id)
    assert after.state == JobState.running and after.reason is None


def test_a_head_that_forgot_the_job_fails_it_resumably(tmp_path: Path, ray_head: RayHead) -> None:
    mgr = create_job_manager(_settings(tmp_path, ray_head.address))
    job = mgr.store.create(name="lost", recipe="cifar10-smoke", overrides={}, nprocs=1,
                           runs_root=mgr.runs_root)
    mgr.store.update(job.id, state=JobState.running, executor="ray", started_at=utcnow(),
                     attempts=1)
    mgr.tick()
    lost = mgr.get(job.id)
    assert lost.state == JobState.failed and lost.reason == LOST.format(id=job.id)
    assert mgr.resume(job.id).state == JobState.queued


def test_a_claim_that_never_reached_ray_is_queued_again(tmp_path: Path,
                                                        ray_head: RayHead) -> None:
    """Its API process died between claiming and submitting: after the grace it is queued
    again (here a local job holds the one slot, so the pass does not launch it)."""
    mgr = create_job_manager(_settings(tmp_path, ray_head.address, jobs_concurrency=1))
    busy = mgr.store.create(name="busy", recipe="cifar10-smoke", overrides={}, nprocs=1,
                            runs_root=mgr.runs_root)
    mgr.store.update(busy.id, state=JobState.running, executor="local", started_at=utcnow())
    fresh = mgr.store.create(name="fresh", recipe="cifar10-smoke", overrides={}, nprocs=1,
                             runs_root=mgr.runs_root)
    mgr.store.update(fresh.id, state=JobState.running, started_at=utcnow(), attempts=1)
    old = mgr.store.create(name="old", recipe="cifar10-smoke", overrides={}, nprocs=1,
                           runs_root=mgr.runs_root)
    mgr.store.update(old.id, state=JobState.running, attempts=1,
                     started_at=utcnow() - timedelta(seconds=120))
    mgr.tick()
    assert mgr.get(old.id).state == JobState.queued and mgr.get(old.id).attempts == 0
    assert mgr.get(fresh.id).state == JobState.running  # inside the grace: being submitted
    assert mgr.get(busy.id).state == JobState.running  # a local job: not Ray's to settle


def test_entrypoint_and_resources_come_from_the_recipe(tmp_path: Path) -> None:
    mgr = create_job_manager(_settings(tmp_path, _dead_address(), ray_cpus_per_proc=2))
    job = mgr.store.create(name="x", recipe="cifar10-vit", overrides={"epochs": 3}, nprocs=2,
                           runs_root=mgr.runs_root)
    cmd = mgr.executor.command(job)  # several processes: a Ray Train driver, N workers
    assert cmd[:6] == [sys.executable, "-m", "training.ray_train", "cifar10-vit", "--run-name",
                       f"job-{job.id}"]
    flags = dict(zip(cmd[6:-2:2], cmd[7:-2:2], strict=True))
    assert flags == {"--workers": "2", "--cpus-per-worker": "2", "--gpus-per-worker": "1",
                     "--storage": f"{mgr.settings.home.resolve()}/ray-train",
                     "--max-failures": "2", "--placement": "PACK"}
    assert cmd[-2:] == ["--set", "epochs=3"]
    assert shlex.split(shlex.join(cmd)) == cmd  # what Ray's shell runs is exactly this
    # the driver reserves nothing; admission counts the workers
    assert mgr.executor.resources(job) == {"entrypoint_num_cpus": 0.0}
    assert mgr.executor.needs(job) == {"CPU": 4.0, "GPU": 2.0}
    cpu = mgr.store.create(name="y", recipe="cifar10-vit-cpu", overrides={}, nprocs=1,
                           runs_root=mgr.runs_root)
    assert mgr.executor.resources(cpu) == {"entrypoint_num_cpus": 2.0}
    resumed = mgr.store.update(cpu.id, resume=1)
    ray = mgr.executor
    assert ray.command(resumed)[-4:] == ["--run-name", f"job-{cpu.id}", "--resume", "if-exists"]
    env = ray.runtime_env()["env_vars"]
    assert set(ray.runtime_env()) == {"env_vars"}  # no code upload: the nodes have the package
    assert env["VIT_SERVICE_HOME"] == str(mgr.settings.home.resolve())
    assert env["RAY_JOB_STOP_WAIT_TIME_S"] == "30"  # the cancel grace: SIGTERM, then SIGKILL


def test_the_interpreter_defaults_to_this_environment_for_a_head_on_this_machine(
        tmp_path: Path) -> None:
    assert _settings(tmp_path, "http://127.0.0.1:8265").resolved_ray_python == sys.executable
    assert _settings(tmp_path, "http://ray-head:8265").resolved_ray_python == "python"
    venv_python = "/opt/venv/bin/python"
    assert _settings(tmp_path, "http://ray-head:8265",
                     ray_python=venv_python).resolved_ray_python == venv_python


def test_a_node_that_cannot_import_the_project_fails_the_job_with_that_reason(
        tmp_path: Path, ray_head: RayHead) -> None:
    """The session's head runs as docs/jobs.md starts one (the venv's `ray start`, the venv
    not on PATH). An interpreter without torch (a bare venv) fails the pre-flight check: the
    job fails with a reason that names the interpreter and the setting, not a traceback."""
    import subprocess
    import venv

    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(bare)
    python = str(bare / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    mgr = create_job_manager(_settings(tmp_path, ray_head.address, ray_python=python))
    job = mgr.submit("cifar10-smoke", {"epochs": 1})
    job = _follow(mgr, job.id, 120)
    assert job.state == JobState.failed, job
    assert job.reason.startswith("pre-flight failed on the node: "), job.reason
    assert f"{python} on " in job.reason and "cannot import torch" in job.reason
    assert "VIT_SERVICE_RAY_PYTHON" in job.reason
