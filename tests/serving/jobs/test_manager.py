"""JobManager mechanics with a small real worker process standing in for `vit-service train`.

(The end-to-end tests with the real trainer and a real API server are in test_jobs_api.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from serving.jobs import Job, JobError, JobManager, JobState
from serving.jobs.local import LocalExecutor, local_command, signal_group
from vit_service.config import Settings

WORKER = r"""
import json, signal, sys, time
steps = int(sys.argv[1]); fail = sys.argv[2] == "fail"
if sys.argv[2] == "usage":  # as `vit-service train` states a bad recipe value, then exits 2
    print("a log line first", file=sys.stderr)
    print("error: data.pseudo_labels: no word in 2 or more labelled texts", file=sys.stderr)
    sys.exit(2)
def term(*_):
    print(json.dumps({"event": "end", "status": "interrupted"}), flush=True); sys.exit(143)
signal.signal(signal.SIGTERM, term)
print(json.dumps({"event": "start", "mlflow_run_id": "abc123", "total_steps": steps}), flush=True)
for i in range(1, steps + 1):
    time.sleep(0.05)
    print(json.dumps({"event": "step", "step": i, "epoch": 0, "loss": 1.0 / i}), flush=True)
if fail:
    print("Traceback: boom", flush=True); sys.exit(3)
print(json.dumps({"event": "end", "status": "succeeded", "val_acc": 0.5}), flush=True)
"""


def _worker_command(job) -> list[str]:
    return [sys.executable, "-c", WORKER, str(job.overrides.get("steps", 5)),
            job.overrides.get("mode", "ok")]


def _validate(recipe: str, overrides: dict) -> None:
    if recipe != "fake":
        raise JobError(422, f"unknown recipe {recipe!r}")


def _manager(settings: Settings) -> JobManager:
    """Runs WORKER instead of the trainer; everything else is the real manager."""
    return JobManager(settings, executor=LocalExecutor(settings, command=_worker_command),
                      validate=_validate)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", data_dir=tmp_path / "data", jobs_poll_s=0.05,
                    jobs_cancel_grace_s=5, jobs_concurrency=1)


def _wait(mgr: JobManager, job_id: str, states: set[JobState], timeout: float = 20) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        mgr.tick()
        if mgr.get(job_id).state in states:
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {mgr.get(job_id).state}")


def test_job_runs_to_success_with_progress(settings: Settings) -> None:
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 4})
    assert job.state == JobState.queued
    _wait(mgr, job.id, {JobState.succeeded})
    done = mgr.get(job.id)
    assert done.exit_code == 0 and done.started_at and done.finished_at
    assert done.mlflow_run_id == "abc123"
    assert done.progress["step"] == 4 and done.progress["metrics"]["val_acc"] == 0.5
    assert any("event" in line for line in mgr.logs(job.id, tail=3))


def test_failure_records_exit_code_and_reason(settings: Settings) -> None:
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 2, "mode": "fail"})
    _wait(mgr, job.id, {JobState.failed})
    done = mgr.get(job.id)
    assert done.exit_code == 3 and "code 3" in done.reason
    assert mgr.logs(job.id, tail=2)[-1].startswith("Traceback")
    assert done.reason == "exited with code 3"  # no error line of the trainer's to quote


def test_a_usage_error_of_the_trainer_is_the_failed_jobs_reason(settings: Settings) -> None:
    """The trainer's one-line error (training/cli.py) is quoted in the reason, so the API
    says what to change without the log."""
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 2, "mode": "usage"})
    _wait(mgr, job.id, {JobState.failed})
    done = mgr.get(job.id)
    assert done.exit_code == 2
    assert done.reason == ("exited with code 2: data.pseudo_labels: no word in 2 or more "
                           "labelled texts")


def test_queue_respects_concurrency_and_cancel(settings: Settings) -> None:
    mgr = _manager(settings)
    a = mgr.submit("fake", {"steps": 200})
    b = mgr.submit("fake", {"steps": 2})
    _wait(mgr, a.id, {JobState.running})
    t0 = time.monotonic()  # let the worker install its SIGTERM handler (it reports steps after)
    while not mgr.get(a.id).progress.get("step") and time.monotonic() - t0 < 20:
        mgr.tick()
        time.sleep(0.05)
    mgr.tick()
    assert mgr.get(b.id).state == JobState.queued  # one at a time
    cancelled_b = mgr.cancel(b.id)
    assert cancelled_b.state == JobState.cancelled
    mgr.cancel(a.id)
    _wait(mgr, a.id, {JobState.cancelled})
    assert mgr.get(a.id).exit_code == 143
    with pytest.raises(JobError) as e:
        mgr.cancel(a.id)
    assert e.value.status == 409


def test_the_queue_admits_by_priority_then_age_and_says_why_a_job_waits(
        settings: Settings) -> None:
    mgr = _manager(settings)
    a = mgr.submit("fake", {"steps": 30})
    _wait(mgr, a.id, {JobState.running})
    low = mgr.submit("fake", {"steps": 1}, name="low")
    urgent = mgr.submit("fake", {"steps": 1}, name="urgent", priority=5)
    later = mgr.submit("fake", {"steps": 1}, name="later")
    assert urgent.queue_position == 1 and "free slot: 1 of 1 running" in urgent.waiting_for
    queued = {j.name: j for j in mgr.list(JobState.queued)}
    assert (queued["low"].queue_position, queued["later"].queue_position) == (2, 3)
    assert queued["later"].waiting_for == "2 jobs ahead in the queue"
    assert mgr.get(a.id).queue_position is None and mgr.get(a.id).waiting_for is None
    mgr.cancel(low.id)  # a cancelled queued job never starts, and the rest move up
    assert mgr.get(later.id).queue_position == 2
    for job in (urgent, later):
        _wait(mgr, job.id, {JobState.succeeded})
    started = {j.name: j.started_at for j in mgr.list()}
    assert started["urgent"] < started["later"] and started["low"] is None


def test_invalid_requests(settings: Settings) -> None:
    mgr = _manager(settings)
    with pytest.raises(JobError) as e:
        mgr.submit("nope", {})
    assert e.value.status == 422
    with pytest.raises(JobError) as e:
        mgr.submit("fake", {"data.data_dir": "/etc"})
    assert e.value.status == 422 and "outside the data and home" in str(e.value.detail)
    with pytest.raises(JobError) as e:
        mgr.submit("fake", {"init.timm_file": "../../etc/passwd"})
    assert e.value.status == 422
    with pytest.raises(JobError) as e:
        mgr.submit("fake", {}, nprocs=99)
    assert e.value.status == 422
    with pytest.raises(JobError) as e:
        mgr.get("missing")
    assert e.value.status == 404


def test_restart_readopts_live_jobs_and_fails_dead_ones(settings: Settings) -> None:
    mgr = _manager(settings)
    live = mgr.submit("fake", {"steps": 60})
    _wait(mgr, live.id, {JobState.running})
    # a second "server" on the same database, while the first is gone (no more ticks)
    mgr2 = _manager(settings)
    mgr2.recover()
    assert mgr2.get(live.id).state == JobState.running
    _wait(mgr2, live.id, {JobState.succeeded})
    assert mgr2.get(live.id).progress["step"] == 60

    # a job that finished while no server was watching is settled from its log, progress too
    quick = mgr2.submit("fake", {"steps": 3})
    _wait(mgr2, quick.id, {JobState.running})
    mgr2.executor.procs[quick.id].proc.wait(20)  # the process ends; this "server" never looks again
    mgr_late = _manager(settings)
    mgr_late.recover()
    settled = mgr_late.get(quick.id)
    assert settled.state == JobState.succeeded and settled.progress["step"] == 3

    dead = mgr2.store.create(name="x", recipe="fake", overrides={}, nprocs=1,
                             runs_root=mgr2.runs_root)
    mgr2.store.update(dead.id, state=JobState.running, pid=999_999_9, pid_start="1")
    mgr3 = _manager(settings)
    mgr3.recover()
    gone = mgr3.get(dead.id)
    assert gone.state == JobState.failed and "resume" in gone.reason
    again = mgr3.resume(dead.id)
    assert again.state == JobState.queued and again.resume
    assert "--resume" not in local_command(again)  # no checkpoint yet: afresh
    ckpt = Path(again.run_dir) / "checkpoints" / "last.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    cmd = local_command(again)
    assert cmd[-2:] == ["--resume", "auto"] and "--set" not in cmd


def test_train_command_runs_the_cli_module_under_torchrun(settings: Settings) -> None:
    """nprocs > 1: ``python -m torch.distributed.run ... -m vit_service.cli train`` (torchrun
    needs the ``-m`` to run a module, not a file named vit_service.cli)."""
    mgr = JobManager(settings)
    job = mgr.store.create(name="x", recipe="cifar10-smoke", overrides={"epochs": 2}, nprocs=2,
                           runs_root=mgr.runs_root)
    assert mgr.executor.command(job) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "vit_service.cli", "train", "cifar10-smoke", "--run-name", f"job-{job.id}",
        "--set", "epochs=2"]
    one = mgr.store.create(name="y", recipe="cifar10-smoke", overrides={}, nprocs=1,
                           runs_root=mgr.runs_root)
    assert mgr.executor.command(one)[:3] == [sys.executable, "-m", "vit_service.cli"]


def _trainer_reads(mgr: JobManager, job: Job) -> Any:
    """The recipe the job's trainer builds from its command line's ``--set`` texts."""
    from training.recipes import load_recipe, parse_overrides

    cmd = mgr.executor.command(job)
    pairs = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    return load_recipe(job.recipe, parse_overrides(pairs))


def test_the_trainer_reads_the_values_the_job_was_validated_with(settings: Settings) -> None:
    """One reading of each value, at submission: what is validated, capped, stored and shown
    is what the trainer's command line carries. A JSON string that spells a count or a list
    ("3", "[0.9, 0.95]") is that count or list; it reached the trainer as the string '3' or
    as a string, not a list. A string read once is never read again: "'100000'" is the text
    100000 (no count, so no way past the caps), "'on'" the text on, not true. Text is carried
    exactly ('#' and ': ' inside a path, characters beyond the BMP), and a text field keeps
    its string (a data set id of sixteen digits is no number)."""
    mgr = JobManager(settings)
    sent = {"epochs": "3", "optim.betas": "[0.9, 0.95]", "augment.hflip": "true",
            "description": "run 😀 # not a comment: \\ \"q\" \u2028 on"}
    job = mgr.submit("cifar10-smoke", sent)
    assert job.overrides == {"epochs": 3, "optim.betas": [0.9, 0.95], "augment.hflip": True,
                             "description": sent["description"]}
    r = _trainer_reads(mgr, job)
    assert (r.epochs, r.optim.betas, r.augment.hflip) == (3, (0.9, 0.95), True)
    assert r.description == sent["description"]
    for twice in ({"epochs": "'100000'"}, {"epochs": '"3"'}, {"augment.hflip": "'on'"},
                  {"epochs": str(settings.jobs_max_epochs + 1)}):  # a cap sees the count
        with pytest.raises(JobError) as e:
            mgr.submit("cifar10-smoke", twice)
        assert e.value.status == 422, twice
    folder = settings.data_dir / "pets #1: cats"
    folder.mkdir(parents=True)
    job = mgr.submit("cifar10-smoke", {"data.dataset": "imagefolder", "register_as": None,
                                       "data.path": "pets #1: cats"})
    assert _trainer_reads(mgr, job).data.path == str(folder.resolve())
    digits = mgr.store.create(name="id", recipe="image-classifier-cpu", nprocs=1,
                              overrides={"data.dataset": "12345678e9012345"},
                              runs_root=mgr.runs_root)
    assert _trainer_reads(mgr, digits).data.dataset == "12345678e9012345"


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))


@pytest.mark.parametrize(("overrides", "says"), [
    ({"description": 3}, "expected a string or null, got 3"),  # a text field: no number
    ({"register_as": True}, "expected a string or null"),
    ({"seed": "2024-01-01"}, "not a JSON value"),  # YAML reads a date: no 500
    ({"seed": "2024-02-30"}, "seed"),  # a date that does not exist: no 500
    ({"optim.betas": "[2024-13-01]"}, "optim.betas"),
    ({"optim.betas": "[0.9, 1.0]"}, "optim.betas"),  # a failed job, not a 422, before
    ({"seed": "9" * 5000}, "seed"),  # past Python's int digits: no 500
    ({"optim.lr": "1e400"}, "not a JSON value"),  # inf
    ({"optim.lr": ".nan"}, "not a JSON value"),
    ({"init.from_": "/etc/passwd"}, "write 'init.from'"),  # the python name: no path check
    ({"init": {"from_": "/etc/passwd"}}, "write 'init.from'"),
    ({"data.path": "pets", "data": {"path": "/etc"}}, "given twice"),  # checked one, ran other
    ({"model.overrides": LAUGHS}, "model.overrides"),  # YAML aliases: never expanded
    ({"optim.betas": "[" * 5000 + "]" * 5000}, "optim.betas"),  # too deep for YAML: no 500
])
def test_overrides_the_checks_could_not_see_are_refused(settings: Settings, overrides: dict,
                                                        says: str) -> None:
    mgr = JobManager(settings)
    t0 = time.perf_counter()
    with pytest.raises(JobError) as e:
        mgr.submit("cifar10-smoke", overrides)
    assert e.value.status == 422 and says in str(e.value.detail), e.value.detail
    assert time.perf_counter() - t0 < 30  # the aliases' 9^9 expansion would never end


def test_a_data_set_id_inside_a_table_stays_text() -> None:
    from training.recipes import parse_override

    table = parse_override("data", "{dataset: 12345678e9012345, val_fraction: 2e-1}")
    assert table == {"dataset": "12345678e9012345", "val_fraction": 0.2}


@pytest.mark.parametrize("overrides", [
    {"init.from": "/etc/passwd"},  # never checked before: the key has no path-like suffix
    {"init": {"from": "../../etc/shadow"}},  # nested, relative
    {"data.path": "~/secrets"},  # ~ would be expanded by the trainer, not by the check
    {"data.path": "../outside"},  # relative to the data folder, then resolved
    {"init.timm_file": "file:///etc/passwd"},
    {"data": {"path": "/"}},
])
def test_every_path_field_is_resolved_before_it_is_checked(settings: Settings,
                                                           overrides: dict) -> None:
    mgr = _manager(settings)
    with pytest.raises(JobError) as e:
        mgr.submit("fake", overrides)
    assert e.value.status == 422, overrides


def test_accepted_paths_reach_the_trainer_resolved(settings: Settings) -> None:
    (settings.data_dir / "mine").mkdir(parents=True)
    mgr = _manager(settings)
    job = mgr.submit("fake", {"data.path": "mine", "init.from": "models:/cifar10-mae@latest",
                              "init": {"timm_file": "mine/w.pt"}})
    assert job.overrides["data.path"] == str((settings.data_dir / "mine").resolve())
    assert job.overrides["init"]["timm_file"] == str(
        (settings.data_dir / "mine" / "w.pt").resolve())
    assert job.overrides["init.from"] == "models:/cifar10-mae@latest"  # not a path


@pytest.mark.parametrize("overrides", [
    {"processes": 1000}, {"threads": 100_000}, {"epochs": 10**9}, {"batch_size": 10**7},
    {"budget_minutes": 10**6},
])
def test_sizes_past_the_servers_caps_are_refused(settings: Settings, overrides: dict) -> None:
    mgr = _manager(settings)
    with pytest.raises(JobError) as e:
        mgr.submit("fake", overrides)
    assert e.value.status == 422 and "limit" in str(e.value.detail)


def test_a_model_too_large_is_refused_before_it_is_queued(tmp_path: Path) -> None:
    mgr = JobManager(Settings(home=tmp_path / "home", data_dir=tmp_path / "data"))
    with pytest.raises(JobError) as e:
        mgr.submit("cifar10-smoke", {"model.overrides.embed_dim": 8192,
                                     "model.overrides.depth": 64})
    assert e.value.status == 422 and "parameters" in str(e.value.detail)
    with pytest.raises(JobError) as e:  # an experiment is a folder name too
        mgr.submit("cifar10-smoke", {"experiment": "../../tmp/x"})
    assert e.value.status == 422
    assert mgr.submit("cifar10-smoke", {"epochs": 1}).state == JobState.queued


def test_a_full_queue_is_429(tmp_path: Path) -> None:
    s = Settings(home=tmp_path / "home", data_dir=tmp_path / "data", jobs_max_queued=2)
    mgr = _manager(s)  # not started: everything stays queued
    mgr.submit("fake", {})
    mgr.submit("fake", {})
    with pytest.raises(JobError) as e:
        mgr.submit("fake", {})
    assert e.value.status == 429 and "queue is full" in str(e.value.detail)


def test_a_failure_right_after_the_claim_fails_the_job_with_its_reason(
        settings: Settings) -> None:
    """The claim marks the job running; its folder cannot be made (a file is in the way):
    the job ends failed with the reason, not running forever with no process."""
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 2})
    Path(job.run_dir).parent.mkdir(parents=True, exist_ok=True)
    Path(job.run_dir).write_text("not a folder")
    mgr.tick()
    done = mgr.get(job.id)
    assert done.state == JobState.failed, done
    assert done.reason.startswith("could not start: FileExistsError")


def test_cancel_leaves_a_finished_job_as_it_ended(settings: Settings) -> None:
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 1})
    _wait(mgr, job.id, {JobState.succeeded})
    with pytest.raises(JobError) as e:
        mgr.cancel(job.id)
    assert e.value.status == 409
    after = mgr.get(job.id)
    assert after.state == JobState.succeeded and after.reason is None


def test_two_hosts_on_one_database_leave_each_others_live_jobs_alone(tmp_path: Path) -> None:
    """Host A runs a job; host B (re)starting on the same database must neither fail it nor
    adopt it (A's pid means nothing on B). Once A dies (its process gone, its lease no longer
    renewed), B settles the job after the lease expires, resumably."""
    common = dict(home=tmp_path / "home", data_dir=tmp_path / "data", jobs_poll_s=0.05,
                  jobs_concurrency=1, jobs_lease_s=1.5)
    a = _manager(Settings(jobs_host_id="host-a", **common))
    b = _manager(Settings(jobs_host_id="host-b", **common))
    job = a.submit("fake", {"steps": 400})
    _wait(a, job.id, {JobState.running})
    assert a.get(job.id).host == "host-a"
    b.recover()
    b.tick()
    assert b.get(job.id).state == JobState.running and job.id not in b.executor.procs
    for _ in range(4):  # A keeps renewing: past one lease, B still leaves it alone
        time.sleep(0.5)
        a.tick()
        b.tick()
    assert b.get(job.id).state == JobState.running
    signal_group(a.executor.procs[job.id].pid, signal.SIGKILL)  # host A goes down
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and b.get(job.id).state == JobState.running:
        b.leases.renewed = float("-inf")  # check now rather than in a third of a lease
        b.tick()
        time.sleep(0.2)
    done = b.get(job.id)
    assert done.state == JobState.failed, done
    assert "host-a stopped renewing its lease" in done.reason and "resume" in done.reason
    assert (time.monotonic() - deadline + 10) >= 1.0  # not before the lease ran out


def test_after_a_step_down_an_attempt_settled_and_resumed_elsewhere_is_left_alone(
        settings: Settings) -> None:
    """This process stops leading mid-job (serving/app.py step-down), the new leader on
    another host settles the job and resumes it there. When this process leads again it
    forgets its old attempt, and its attempt's end never overwrites the job."""
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 30})
    _wait(mgr, job.id, {JobState.running})
    mgr.start()
    mgr.step_down()
    assert job.id in mgr.executor.procs
    # the other host: settled it, resumed it, and runs it now
    mgr.store.update(job.id, state=JobState.running, host="other-host", attempts=2,
                     reason=None)
    mgr.start()  # leads again: forgets, then re-adopts only what is still its host's
    try:
        assert job.id not in mgr.executor.procs
        time.sleep(2.5)  # the old attempt ends meanwhile
        mgr.tick()
        now = mgr.get(job.id)
        assert now.state == JobState.running and now.host == "other-host", now
    finally:
        mgr.stop()


def test_a_manager_that_stepped_down_follows_its_own_attempts_to_the_end_and_launches_nothing(
        settings: Settings) -> None:
    """A leader that loses its lock (serving/app.py) keeps following the attempts it started:
    their leases stay fresh (another host would otherwise fail them as abandoned once they
    expired) and their ends are recorded; nothing queued is launched, no other host's expired
    job is settled, until it leads again."""
    settings = settings.model_copy(update={"jobs_lease_s": 0.6})
    mgr = _manager(settings)
    mine = mgr.submit("fake", {"steps": 60})  # ~3 s
    mgr.start()
    try:
        _wait(mgr, mine.id, {JobState.running})
        mgr.step_down()
        queued = mgr.submit("fake", {"steps": 2})
        # another host's job whose lease expired long ago: only a leader settles it
        theirs = mgr.submit("fake", {"steps": 2})
        old = mgr.store.get(mine.id).started_at  # type: ignore[union-attr]
        mgr.store.update(theirs.id, state=JobState.running, host="other-host",
                         executor="local", started_at=old, heartbeat_at=old)
        beats = set()
        t0 = time.monotonic()
        while mgr.get(mine.id).state == JobState.running and time.monotonic() - t0 < 20:
            beats.add(mgr.store.get(mine.id).heartbeat_at)  # type: ignore[union-attr]
            time.sleep(0.05)
        done = mgr.get(mine.id)
        assert done.state == JobState.succeeded and done.exit_code == 0, done
        assert len(beats) >= 2, beats  # renewed while following, not only at launch
        time.sleep(0.3)
        assert mgr.get(queued.id).state == JobState.queued
        assert mgr.get(theirs.id).state == JobState.running
        mgr.start()  # leads again: launches the queued job, settles the expired one
        _wait(mgr, queued.id, {JobState.succeeded})
        gone = mgr.get(theirs.id)
        assert gone.state == JobState.failed and "stopped renewing its lease" in gone.reason
    finally:
        mgr.stop()


def test_leading_again_keeps_the_handle_of_an_attempt_that_ended_meanwhile(
        settings: Settings) -> None:
    """An attempt that ends after a step-down and before this process leads again (no pass
    recorded its end) keeps its process handle through the new lead: its exit code and
    reason are the real ones, not a "gone" read from the log of a process found by pid."""
    mgr = _manager(settings)
    job = mgr.submit("fake", {"steps": 3, "mode": "fail"})
    _wait(mgr, job.id, {JobState.running})
    mgr.step_down()
    _until_ended_unreaped(mgr.executor.procs[job.id].pid)  # only its handle has the exit
    mgr.start()
    try:
        _wait(mgr, job.id, {JobState.failed, JobState.succeeded})
        done = mgr.get(job.id)
        assert done.state == JobState.failed and done.exit_code == 3, done
        assert done.reason.startswith("exited with code 3"), done.reason
    finally:
        mgr.stop()


def test_a_lead_starting_after_the_shutdown_does_nothing(settings: Settings) -> None:
    """The server shuts down while a lead is still starting (its start() runs in a thread the
    shutdown cannot cancel): once stop() was called, start() launches nothing and leaves no
    scheduler thread behind."""
    mgr = _manager(settings)
    mgr.stop()
    job = mgr.submit("fake", {"steps": 2})
    mgr.start()
    time.sleep(0.5)  # ten polls of a scheduler, had one started
    assert mgr.get(job.id).state == JobState.queued
    assert mgr._thread is None  # (other tests' threads may still be ending: not enumerated)


LAUNCHER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _until_ended_unreaped(pid: int) -> None:
    """Wait until ``pid`` has ended and its parent has not read its end (a zombie)."""
    t0 = time.monotonic()
    while Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() - t0 < 20, "the attempt did not end"
        time.sleep(0.05)


@contextlib.contextmanager
def _siblings_attempt(mgr: JobManager, code: str) -> Iterator[tuple[Job, int, subprocess.Popen]]:
    """A running job of this host whose attempt (``python -c code``) was started by another
    live process (LAUNCHER, standing in for a sibling API process), its lease just renewed.
    Yields (job, the attempt's pid, the launcher); both processes are killed after."""
    from serving.jobs.local import _proc_start
    from serving.jobs.store import utcnow

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, code],
                                stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(launcher.stdout.readline())  # type: ignore[union-attr]
        job = mgr.submit("fake", {"steps": 2})
        mgr.store.update(job.id, state=JobState.running, host=mgr.host, executor="local",
                         pid=child, pid_start=_proc_start(child), started_at=utcnow(),
                         heartbeat_at=utcnow())
        yield mgr.get(job.id), child, launcher
    finally:
        launcher.kill()
        launcher.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_sibling_processs_attempt_is_left_to_it_until_nobody_renews_its_lease(
        settings: Settings) -> None:
    """Two API processes of one host (`--workers N` on PostgreSQL, one host id): the one that
    led started an attempt and, having stepped down, still follows it. The new leader leaves
    it to that process while its lease is renewed (two followers would race to record its
    end, the one without its handle with no exit code); once that process is gone and the
    lease ran out, the leader adopts the attempt, and settles it when it ends."""
    from serving.jobs.store import utcnow

    mgr = _manager(settings.model_copy(update={"jobs_lease_s": 5.0}))
    with _siblings_attempt(mgr, "import time; time.sleep(120)") as (job, child, launcher):
        assert mgr.executor.followed_elsewhere(mgr.get(job.id))
        assert mgr.recover() == set() and job.id not in mgr.executor.procs
        mgr.tick()  # the leader's pass: the lease is fresh, so still the sibling's
        assert job.id not in mgr.executor.procs and mgr.get(job.id).state == JobState.running
        launcher.kill()  # the sibling is gone; its attempt goes on, re-parented
        launcher.wait()
        long_ago = utcnow() - timedelta(seconds=6)  # and nobody renewed the lease since
        mgr.store.update(job.id, heartbeat_at=long_ago, started_at=long_ago)
        mgr.leases.renewed = float("-inf")
        mgr.tick()
        assert job.id in mgr.executor.procs, mgr.get(job.id)
        signal_group(child, signal.SIGKILL)
        _wait(mgr, job.id, {JobState.failed, JobState.succeeded})
        done = mgr.get(job.id)
        assert done.state == JobState.failed and "exit status unknown" in done.reason, done


def test_a_siblings_attempt_that_just_ended_is_left_for_it_to_record(
        settings: Settings) -> None:
    """The sibling's attempt has ended and the sibling has not read its end yet (a zombie,
    its exit code waiting in its parent): the new leader must not settle it from its log
    ("exit status unknown") before the sibling records the real exit code."""
    mgr = _manager(settings.model_copy(update={"jobs_lease_s": 30.0}))
    with _siblings_attempt(mgr, "raise SystemExit(3)") as (job, child, _):
        _until_ended_unreaped(child)
        assert mgr.executor.followed_elsewhere(mgr.get(job.id))
        assert mgr.recover() == set()
        assert mgr.get(job.id).state == JobState.running
