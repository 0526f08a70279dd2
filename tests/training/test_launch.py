"""``processes: N``: ``vit-service train`` runs itself as N Gloo DDP ranks (training/launch.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.training.conftest import QUIET, REPO, mlflow_client, progress_events
from training import launch
from training.checkpoint import load_checkpoint
from training.signals import StopFlag

PY = sys.executable


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "rank.py"
    path.write_text("import os, signal, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return [PY, str(path)]


def test_every_rank_gets_its_place_in_one_group(tmp_path: Path) -> None:
    cmd = _script(tmp_path, "import json\nkeys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
                  "'MASTER_ADDR', 'MASTER_PORT', 'OMP_NUM_THREADS', 'VIT_SERVICE_STARTED_AT']\n"
                  f"open(r'{tmp_path}/env%d.json' % rank, 'w').write("
                  "json.dumps({k: os.environ[k] for k in keys}))\n")
    assert launch.launch(2, cmd, started_at=123.5, threads=1) == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)]
    assert [e["RANK"] for e in envs] == ["0", "1"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert {float(e["VIT_SERVICE_STARTED_AT"]) for e in envs} == {123.5}


def test_a_rank_that_dies_stops_the_others(tmp_path: Path) -> None:
    cmd = _script(tmp_path, "if rank == 1:\n    sys.exit(3)\ntime.sleep(120)\n")
    t0 = time.monotonic()
    assert launch.launch(2, cmd, started_at=0.0, threads=1) == 3  # the dead rank's code
    assert time.monotonic() - t0 < 30  # rank 0 was not left waiting for its peer


def test_a_signal_reaches_every_rank_and_rank_0_gives_the_code(tmp_path: Path) -> None:
    cmd = _script(tmp_path, "def stop(signum, frame):\n"
                  f"    open(r'{tmp_path}/stopped%d' % rank, 'w').write(str(signum))\n"
                  "    sys.exit(143)\n"
                  "signal.signal(signal.SIGTERM, stop)\n"
                  f"open(r'{tmp_path}/ready%d' % rank, 'w').close()\n"
                  "time.sleep(120)\n")

    def send() -> None:  # to the launcher (this process) alone, as `kill PID` would
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                (tmp_path / f"ready{r}").exists() for r in range(2)):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()
    assert launch.launch(2, cmd, started_at=0.0, threads=1) == 143
    assert [(tmp_path / f"stopped{r}").read_text() for r in range(2)] == [
        str(int(signal.SIGTERM))] * 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the launcher's handler is gone


def test_a_doubly_delivered_ctrl_c_is_one_stop_request() -> None:
    flag = StopFlag()
    flag._handle(signal.SIGINT, None)
    flag._handle(signal.SIGINT, None)  # the forwarded copy, milliseconds later: no abort
    assert flag.signum == signal.SIGINT
    flag._at -= 2 * flag.REPEAT_S  # a second Ctrl-C, pressed later: give up at once
    with pytest.raises(KeyboardInterrupt):
        flag._handle(signal.SIGINT, None)


def test_started_at_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch.ENV_STARTED_AT, "42.25")
    assert launch.started_at_from_env() == 42.25
    monkeypatch.delenv(launch.ENV_STARTED_AT)
    assert launch.started_at_from_env() is None


def test_train_with_processes_2_is_one_ddp_run(tmp_path: Path, data_dir: Path, mlflow_db) -> None:
    """``vit-service train cifar10-smoke --set processes=2``: no torchrun, two ranks of one
    thread each, one run, rank 0 alone reports."""
    home = tmp_path / "home"
    uri = mlflow_db(home)
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, **QUIET,
           "VIT_SERVICE_HOME": str(home), "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache"),
           "MLFLOW_TRACKING_URI": uri}
    cmd = [PY, "-m", "vit_service.cli", "train", "cifar10-smoke", "--data-dir", str(data_dir),
           "--device", "cpu", "--set", "processes=2", "--set", "epochs=1",
           "--set", "attention_samples=0", "--run-name", "two", "--no-register"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    events = progress_events(proc.stdout)
    assert [e["event"] for e in events].count("start") == 1
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "finished"
    assert end["step"] == end["total_steps"] == 12  # 400 images / global batch 32
    ck = load_checkpoint(home / "runs" / "two" / "checkpoints" / "last.pt")
    assert ck["world_size"] == 2 and len(ck["rng"]) == 2
    run = mlflow_client(uri).get_run(end["mlflow_run_id"])
    assert run.data.params["train.world_size"] == "2"
    assert run.data.params["recipe.processes"] == "2"
