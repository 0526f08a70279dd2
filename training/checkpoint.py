"""Checkpoints: atomic writes, ``weights_only`` loads, and every RNG state needed to resume.

A checkpoint is a plain dict of tensors and builtins (no pickled classes), so
``torch.load(path, weights_only=True)`` reads it::

    model, ema, optimizer, scheduler   state dicts (ema None when off)
    step, epoch, batch_in_epoch        where training stands: the next step trains batch
                                       ``batch_in_epoch`` of ``epoch``
    rng                                one entry per DDP rank: python, numpy, torch, cuda
    recipe, model_config               the resolved recipe and model config (plain dicts)
    mlflow_run_id, run_name, metrics   so ``--resume`` continues the same MLflow run

Files live in ``<run dir>/checkpoints/``: ``last.pt`` is replaced (tmp file + ``os.replace``)
at the end of every epoch, when training stops (``max_steps``, SIGTERM) and at the end.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

LAST = "last.pt"
RUN_INFO = "run.json"  # {"recipe", "run_name", "mlflow_run_id"} written at the start


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states as tensors and builtins."""
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": np_state[0], "key": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: a temp file in the same folder, fsync, then
    ``os.replace`` - a reader (or a crash) never sees a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("checkpoint step %d -> %s", state.get("step", -1), path)
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True`` (no code runs while loading)."""
    return torch.load(path, map_location=map_location, weights_only=True)


def find_checkpoint(runs_dir: Path, spec: str, run_name: str | None = None,
                    recipe: str | None = None) -> Path:
    """``--resume`` argument -> checkpoint file.

    ``spec`` is a file, a run folder, or ``auto``: ``last.pt`` of ``run_name`` if given, else the
    newest ``runs/*/checkpoints/last.pt`` (of ``recipe`` when given).
    """
    if spec != "auto":
        p = Path(spec)
        for c in (p, p / LAST, p / "checkpoints" / LAST):
            if c.is_file():
                return c
        raise FileNotFoundError(f"no checkpoint at {p}")
    if run_name:
        c = runs_dir / run_name / "checkpoints" / LAST
        if not c.is_file():
            raise FileNotFoundError(f"no checkpoint for run {run_name!r} ({c})")
        return c
    found = sorted(runs_dir.glob(f"*/checkpoints/{LAST}"), key=lambda p: p.stat().st_mtime)
    if recipe:
        found = [p for p in found if _run_recipe(p.parent.parent) == recipe]
    if not found:
        raise FileNotFoundError(
            f"--resume auto: no checkpoints{f' of recipe {recipe}' if recipe else ''} "
            f"under {runs_dir}")
    return found[-1]


def _run_recipe(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RUN_INFO).read_text()).get("recipe")
    except (OSError, ValueError):
        return None
