"""``processes: N`` on the CPU: ``vit-service train`` starts N data-parallel ranks itself.

A CPU recipe can ask for ``processes: N``: the command re-runs itself as N ranks of a Gloo DDP
run (what ``torchrun --standalone --nproc_per_node N`` would do, without asking the user to know
that), each with ``cores / N`` intra-op threads; ``batch_size`` stays the global batch.

On a 2-core CPU two ranks gain nothing over one process of two threads (the ranks wait on
each other at every step: docs/training.md, "One process per core"), so no shipped recipe
uses it; it is there for many-core CPU hosts, where one process rarely scales to every core.

What the launcher owes the user, tested in ``tests/training/test_launch.py``:

* one run: the ranks share the run name, rank 0 logs, checkpoints and registers;
* the budget counts from the command's start, not from the ranks' (``VIT_SERVICE_STARTED_AT``);
* SIGTERM / SIGINT reach every rank (they all-reduce the stop flag, checkpoint, and exit 143 /
  130), and the command exits with rank 0's code;
* a rank that dies does not leave the others blocked in a collective: they are stopped, and the
  command exits with the dead rank's code.

Standard library only (the parent imports nothing heavy before the ranks start).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

ENV_STARTED_AT = "VIT_SERVICE_STARTED_AT"  # the command's start, time.monotonic() (system-wide)
STOP_GRACE_S = 60.0  # after a rank fails: how long the others get to stop before SIGKILL


def is_rank() -> bool:
    """Whether this process already is one rank of a distributed run (ours or torchrun's)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def cores() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, n: int, port: int, started_at: float, threads: int,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank ``rank`` of ``n`` (torchrun's variable names)."""
    env = dict(os.environ if base is None else base)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), ENV_STARTED_AT: repr(started_at),
                "OMP_NUM_THREADS": str(threads)})
    return env


def launch(n: int, cmd: Sequence[str], started_at: float, threads: int | None = None,
           poll_s: float = 0.2) -> int:
    """Run ``cmd`` as ranks ``0..n-1`` and wait for them; returns rank 0's exit code, or the
    code of the first rank that failed while the others were still running."""
    threads = threads or max(1, cores() // n)
    port = _free_port()
    log.info("starting %d training processes (Gloo DDP), %d thread(s) each", n, threads)
    # the ranks stay in this process group, so that a job executor's killpg reaches them
    # all; a Ctrl-C at the terminal then reaches each rank twice (directly and forwarded), which
    # the trainer counts as one (training/signals.py, StopFlag)
    procs = [subprocess.Popen(list(cmd), env=rank_env(r, n, port, started_at, threads))
             for r in range(n)]
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed: int | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]  # every rank's (any() would stop at the first)
            if all(c is not None for c in codes):
                break
            bad = [c for c in codes if c not in (None, 0)]
            if bad and failed is None and not forwarded:
                failed = bad[0]  # a rank died on its own: stop the others
                log.error("a training process exited with %d: stopping the others", failed)
                _stop(procs)
                break
            time.sleep(poll_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for p in procs:
        p.wait()
    return failed if failed is not None else procs[0].returncode


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM the ranks still running, SIGKILL those still there after the grace."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def started_at_from_env() -> float | None:
    """The launching command's start (``time.monotonic()``), in a rank it started."""
    value = os.environ.get(ENV_STARTED_AT)
    try:
        return float(value) if value else None
    except ValueError:
        return None


def train_command(argv: Sequence[str]) -> list[str]:
    """``vit-service train ARGV`` as a command this interpreter runs."""
    return [sys.executable, "-m", "vit_service.cli", "train", *argv]
