"""One real Ray cluster on loopback for the tests that run jobs on Ray.

``ray start --head --num-cpus 2 --dashboard-host 127.0.0.1`` with its own temp folder and
ports, started once per test session (by the first test that asks for it) and stopped at the
end (its own processes only, found by its temp folder: no other Ray on the machine is hit).
The object store is kept small: these jobs pass no objects.

:meth:`RayHead.add_node` joins a second node to it (``ray start --address``, another raylet
on this machine with a custom resource named after it), and :meth:`RayHead.kill_node` SIGKILLs
that node's raylet, as a machine that dies would: the multi-node tests. Every node gets ports
of its own (the dashboard agent's default port would clash between nodes, and with any other
Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent_ports() -> list[str]:
    """Ports of a node's agents, free now (their defaults are fixed and would clash)."""
    return [f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}"]


@dataclass
class RayHead:
    address: str  # the dashboard / Job Submission address, http://127.0.0.1:PORT
    temp_dir: Path
    env: dict[str, str]
    gcs_port: int
    started_s: float  # seconds `ray start` took until the Job API answered

    def add_node(self, name: str, num_cpus: int = 1, timeout_s: float = 60) -> None:
        """Join a node (a raylet with ``num_cpus`` CPUs and the custom resource ``name``)."""
        cmd = [str(RAY), "start", f"--address=127.0.0.1:{self.gcs_port}",
               f"--num-cpus={num_cpus}", "--num-gpus=0", "--node-ip-address=127.0.0.1",
               f"--object-store-memory={80 * 1024 * 1024}", f"--resources={{\"{name}\": 1}}",
               "--disable-usage-stats", *_agent_ports()]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start (node {name}) failed:\n{proc.stderr[-3000:]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # until the head counts it
            if name in self.alive_resources():
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {name} did not join the cluster")

    def alive_resources(self) -> set[str]:
        """The custom resource names of the live nodes (the state API over HTTP)."""
        r = httpx.get(f"{self.address}/nodes?view=summary", timeout=10)
        names: set[str] = set()
        for node in r.json()["data"]["summary"]:
            raylet = node.get("raylet", {})
            if raylet.get("state") == "ALIVE":
                names.update(raylet.get("resourcesTotal", {}))
        return names

    def raylet_pid(self, name: str) -> int | None:
        """The pid of the raylet that offers the custom resource ``name``."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and args[0].endswith(b"/raylet") and any(
                    a.startswith(b"--static_resource_list=") and f"{name},1".encode() in a
                    for a in args):
                return int(entry.name)
        return None

    def kill_node(self, name: str) -> int:
        """SIGKILL node ``name``'s raylet (its workers die with it); the pid killed."""
        pid = self.raylet_pid(name)
        if pid is None:
            raise RuntimeError(f"no raylet offers {name}")
        os.kill(pid, signal.SIGKILL)
        return pid

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: those whose command line names its temp folder (GCS,
        raylets, dashboard, agents: every node's session lives under it) and their
        descendants (the workers, jobs' drivers)."""
        mark = str(self.temp_dir)
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(mark in a for a in p.info["cmdline"] or ()):
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                continue
        return list(found.values())

    def stop(self) -> None:
        """Stop this cluster only (``ray stop`` would stop every Ray on the machine)."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
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
           "--disable-usage-stats", *_agent_ports()]
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
