"""Jobs as local processes: each attempt is its own ``vit-service train`` process (under
torchrun for several processes), in its own session (process group), output to
``<run_dir>/job.log``.

Such processes survive a restart of the API server: on start-up the manager re-adopts live ones
(checked by pid *and* process start time, :meth:`LocalExecutor.adopt`) and settles the others
from their logs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.jobs.admission import Capacity, Node, Shape
from serving.jobs.commands import train_command
from serving.jobs.executor import (
    CANCEL_REQUESTED,
    Ended,
    LaunchFailed,
    Poll,
    Running,
    Vanished,
)
from serving.jobs.model import Job, JobState
from serving.jobs.progress import failure_reason
from vit_service.config import Settings

log = logging.getLogger(__name__)



def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...), or None
    if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _proc_start(pid: int) -> str | None:
    """Kernel start time of ``pid`` (guards against pid reuse), or None if it is gone."""
    stat = _stat(pid)
    return stat[19] if stat is not None else None  # field 22: starttime (index 19 here)


def alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` is a live (not zombie) process that started at ``start``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and (start is None or stat[19] == start)


def signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the whole process group: torchrun and its workers."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def local_command(job: Job) -> list[str]:
    """The trainer's command line for a local attempt: resumed from the run's checkpoint when
    the job is resumed and one exists (the checkpoint holds the resolved recipe), else afresh
    with the overrides."""
    resume_from = Path(job.run_dir) / "checkpoints" / "last.pt"
    return train_command(job, sys.executable,
                         "auto" if job.resume and resume_from.exists() else None)


@dataclass
class Process:
    """An attempt this API process follows."""

    proc: subprocess.Popen | None  # None: adopted after a restart (not our child)
    pid: int
    pid_start: str | None
    cancel_at: float | None = None  # monotonic time SIGTERM was sent
    killed: bool = False


class LocalExecutor:
    """Attempts as processes of this host (module docstring)."""

    name = "local"
    host_bound = True

    def __init__(self, settings: Settings,
                 command: Callable[[Job], list[str]] = local_command) -> None:
        self.settings = settings
        self.command = command
        self.concurrency = settings.jobs_concurrency or _gpu_count()
        self.procs: dict[str, Process] = {}
        self._gpus: int | None = None  # torch's count, read once
        self._lock = threading.Lock()  # the scheduler polls while an API request stops

    def start(self) -> None:
        pass

    def check(self) -> None:
        pass

    def launch(self, job: Job) -> dict[str, Any]:
        # from the claim on, the job either starts or is failed with the reason: nothing may
        # leave it marked running with no process (a full disk, a folder in the way)
        try:
            run_dir = Path(job.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = self.command(job)
            s = self.settings
            env = {**os.environ, "PYTHONUNBUFFERED": "1",
                   "MLFLOW_TRACKING_URI": s.resolved_tracking_uri,
                   "VIT_SERVICE_HOME": str(s.home.resolve()),
                   "VIT_SERVICE_DATA_DIR": str(s.data_dir.resolve())}
            with open(job.log_path, "ab") as logf:
                logf.write(f"# {' '.join(cmd)}\n".encode())
                logf.flush()
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=run_dir,
                                        start_new_session=True)
        except Exception as e:  # noqa: BLE001 (whatever it was, the job must not hang)
            log.exception("job %s could not start", job.id)
            raise LaunchFailed(f"could not start: {type(e).__name__}: {e}") from e
        start = _proc_start(proc.pid)
        self.procs[job.id] = Process(proc, proc.pid, start)
        log.info("job %s started (pid %d): %s", job.id, proc.pid, " ".join(cmd))
        return {"pid": proc.pid, "pid_start": start, "executor": self.name}

    def forget(self, keep: Collection[str] = ()) -> None:
        with self._lock:
            for k in [k for k in self.procs if k not in keep]:
                del self.procs[k]

    def followed_elsewhere(self, job: Job) -> bool:
        # its launcher is still alive: another API process of this host (a `--workers N`
        # sibling that led before, now following only its own attempts). Once that process
        # is gone its attempts are re-parented to init (or a subreaper): then no longer.
        # (a zombie counts: an attempt that just ended, its end not yet read by its parent)
        stat = _stat(job.pid) if job.pid is not None else None
        if job.id in self.procs or stat is None or job.pid_start not in (None, stat[19]):
            return False
        parent = int(stat[1])  # field 4: ppid
        return parent not in (0, 1, os.getpid()) and alive(parent, None)

    def adopt(self, job: Job) -> bool:
        held = self.procs.get(job.id)
        if held is not None and held.pid == job.pid:
            return True  # still followed (a step-down and a new lead): its handle has the exit
        if job.pid is None or not alive(job.pid, job.pid_start):
            return False
        log.info("re-adopting running job %s (pid %d)", job.id, job.pid)
        self.procs[job.id] = Process(None, job.pid, job.pid_start)
        return True

    def following(self, running: list[Job]) -> list[str]:
        return list(self.procs)  # this process's own, whatever the table says meanwhile

    def poll(self, job: Job) -> Poll:
        with self._lock:
            return self._poll(job, self.procs[job.id])

    def _poll(self, job: Job, p: Process) -> Poll:
        if p.cancel_at is None and job.reason == CANCEL_REQUESTED:
            self._term(p)  # asked through another process (a worker)
        if p.cancel_at is not None and not p.killed and \
                time.monotonic() - p.cancel_at > self.settings.jobs_cancel_grace_s:
            log.warning("job %s ignored SIGTERM for %.0fs; killing it", job.id,
                        self.settings.jobs_cancel_grace_s)
            signal_group(p.pid, signal.SIGKILL)
            p.killed = True
        if p.proc is None:  # adopted: only whether it still lives can be known
            if alive(p.pid, p.pid_start):
                return Running()
            del self.procs[job.id]
            return Vanished("the process ended while not our child")
        code = p.proc.poll()
        if code is None:
            return Running()
        del self.procs[job.id]
        if p.cancel_at is not None or job.reason == CANCEL_REQUESTED:
            return Ended(JobState.cancelled, "cancelled" + (" (killed)" if p.killed else ""),
                         code)
        if code == 0:
            return Ended(JobState.succeeded, None, code)
        return Ended(JobState.failed, failure_reason(job.log_path, code), code)

    def stop(self, job: Job) -> None:
        with self._lock:
            p = self.procs.get(job.id)
            if p is not None and p.cancel_at is None:
                self._term(p)

    @staticmethod
    def _term(p: Process) -> None:
        signal_group(p.pid, signal.SIGTERM)
        p.cancel_at = time.monotonic()

    # --- admission ------------------------------------------------------------------------------
    @property
    def cpus(self) -> float:
        """CPUs local jobs may hold: ``jobs_cpus``, else those this process may run on."""
        from training.launch import cores

        return float(self.settings.jobs_cpus or cores())

    @property
    def gpus(self) -> int:
        """GPUs local jobs may hold: ``jobs_gpus``, else the ones torch sees."""
        if self.settings.jobs_gpus is not None:
            return self.settings.jobs_gpus
        if self._gpus is None:
            self._gpus = _gpu_count(at_least=0)
        return self._gpus

    def needs(self, job: Job) -> dict[str, float]:
        """From the recipe: a GPU per process for ``device: cuda`` (and ``auto`` when this
        machine has one); CPUs: its ``threads`` per process (``processes`` ranks of a CPU
        recipe, times ``nprocs``), capped at the machine's, so any job fits an idle machine.
        A CPU recipe without ``threads`` runs torch's default, every core: it takes them all;
        a GPU one takes a core per process (its threads mostly wait on the GPU)."""
        from training.recipes import load_recipe, setting_texts

        recipe = load_recipe(job.recipe, setting_texts(job.overrides))
        cpus = self.cpus
        if recipe.device == "cuda" or (recipe.device == "auto" and self.gpus > 0):
            return {"GPU": float(job.nprocs),
                    "CPU": min(cpus, float((recipe.threads or 1) * job.nprocs))}
        if recipe.threads is None:
            return {"CPU": cpus}
        return {"CPU": min(cpus, float(recipe.threads * recipe.processes * job.nprocs))}

    def placement(self, job: Job) -> Shape:
        return Shape()  # one machine

    def capacity(self) -> Capacity:
        """This machine, with nothing read of what is free: the manager takes what this
        host's running jobs need off the total."""
        return Capacity([Node({"CPU": self.cpus, "GPU": float(self.gpus)})])


def _gpu_count(at_least: int = 1) -> int:
    """The GPUs torch sees; at least one by default: one job per GPU by default (one at a
    time without any)."""
    try:
        import torch

        return max(at_least, torch.cuda.device_count())
    except Exception:  # torch missing or CUDA probing failed
        return at_least
