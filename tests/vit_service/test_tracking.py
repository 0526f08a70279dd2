"""A fresh SQLite tracking store opened by several processes at once is made once
(vit_service.tracking.init_sqlite_store), not migrated by each of them side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlflow import MlflowClient

OPEN = ("import sys; from vit_service import tracking; "
        "tracking.configure(sys.argv[1]); import mlflow; "
        "mlflow.set_experiment(sys.argv[2]); print('ok')")


def test_processes_opening_a_new_store_together_all_succeed(tmp_path: Path) -> None:
    """Three processes (a server and trainers on a new home) open one new SQLite store at
    the same moment: each one gets a working store and its experiment."""
    uri = f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    procs = [subprocess.Popen([sys.executable, "-c", OPEN, uri, f"exp-{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip() == "ok", err[-3000:]
    names = {e.name for e in MlflowClient(uri, uri).search_experiments()}
    assert {"exp-0", "exp-1", "exp-2"} <= names
