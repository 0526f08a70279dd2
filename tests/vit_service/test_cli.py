"""The console entry point ``vit_service.cli:run``: exits without the interpreter's module
teardown, but keeps what a normal exit does that matters (exit code, atexit handlers, flushed
output, joined threads); and ``process_started_at`` dates the process's start."""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_run_keeps_the_exit_code_output_atexit_handlers_and_threads(tmp_path: Path) -> None:
    mark, joined = tmp_path / "atexit", tmp_path / "thread"
    code = f"""
import atexit, sys, threading, time
from pathlib import Path
atexit.register(lambda: Path({str(mark)!r}).write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), Path({str(joined)!r}).write_text("done"))
                 ).start()
sys.argv = ["vit-service", "recipes"]
sys.stdout.write("x" * 100000)  # more than a pipe buffer, not yet flushed
from vit_service.cli import run
run()
print("not reached")
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("x" * 100000)
    assert "cifar10-vit-cpu" in proc.stdout and "not reached" not in proc.stdout
    assert mark.read_text() == "ran" and joined.read_text() == "done"


def test_run_exits_with_idle_thread_pool_workers_alive() -> None:
    # MLflow's artifact repository keeps a ThreadPoolExecutor whose idle, non-daemon workers
    # only leave when the interpreter's threading-atexit hook wakes them: joining them without
    # it hung a finished 30-minute training run at exit
    code = """
import concurrent.futures as cf, sys
pool = cf.ThreadPoolExecutor(2)  # referenced until the end, like MLflow's cached repository
pool.submit(print, "worked").result()
sys.argv = ["vit-service", "recipes"]
from vit_service.cli import run
run()
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # TimeoutExpired: the exit hung
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("worked") and "cifar10-vit-cpu" in proc.stdout


def test_run_passes_a_failing_commands_exit_code() -> None:
    proc = _python('import sys; sys.argv = ["vit-service", "recipes", "show", "no-such-recipe"]\n'
                   "from vit_service.cli import run; run()")
    assert proc.returncode not in (0, None), proc.stdout
    assert "no-such-recipe" in proc.stderr


def test_process_started_at_counts_the_time_before_it_was_called() -> None:
    t0 = time.monotonic()
    proc = _python("import time; time.sleep(1.0)\n"
                   "from training.cli import process_started_at\n"
                   "print(time.monotonic() - process_started_at())")
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    age = float(proc.stdout)
    # /proc dates the start in clock ticks (10 ms) and /proc/uptime has 10 ms steps: allow two
    # steps either side; a start dated at import (age ~0) or at boot still fails.
    slack = 2 * 0.01
    assert 1.0 - slack <= age <= wall + slack, (age, wall)
