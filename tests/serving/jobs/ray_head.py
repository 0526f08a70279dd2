"""One real single-node Ray cluster on loopback for the tests that run jobs on Ray.

``ray start --head --num-cpus 2 --dashboard-host 127.0.0.1`` with its own temp folder and
ports, started once per test session (by the first test that asks for it) and stopped at the
end (``ray stop`` scoped to this cluster's temp folder, so no other Ray on the machine is hit).
The object store is kept small: these jobs pass no objects.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayHead:
    address: str  # the dashboard / Job Submission address, http://127.0.0.1:PORT
    temp_dir: Path
    env: dict[str, str]
    gcs_port: int
    started_s: float  # seconds `ray start` took until the Job API answered

    def stop(self) -> None:
        subprocess.run([str(RAY), "stop", "--force"], env=self.env, capture_output=True,
                       timeout=120)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray_head(num_cpus: int = 2) -> RayHead:
    if not RAY.exists():
        raise RuntimeError(f"{RAY} not found: install the ray extra (pip install -e '.[ray]')")
    # a short path: Ray's unix sockets live under it and must stay below ~107 characters
    temp_dir = Path(tempfile.mkdtemp(prefix="vsray-", dir="/tmp"))
    dash, gcs = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VIT_SERVICE_"))}
    # started as docs/jobs.md tells users: the venv's `ray start`, the venv not activated (its
    # bin/ not on PATH), so a bare `python` in a job's entrypoint is not the project's
    path = [p for p in env.get("PATH", "").split(":") if p and Path(p) != RAY.parent]
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "PATH": ":".join(path)})
    t0 = time.monotonic()
    cmd = [str(RAY), "start", "--head", f"--num-cpus={num_cpus}", "--num-gpus=0",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--port={gcs}",
           "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
           f"--object-store-memory={80 * 1024 * 1024}", "--include-dashboard=true",
           "--disable-usage-stats"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    address = f"http://127.0.0.1:{dash}"
    head = RayHead(address, temp_dir, env, gcs, 0.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the Job API comes up a little after `ray start`
        try:
            if httpx.get(f"{address}/api/version", timeout=2).status_code == 200:
                head.started_s = time.monotonic() - t0
                return head
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    head.stop()
    raise RuntimeError(f"the Ray Job API at {address} did not come up")
