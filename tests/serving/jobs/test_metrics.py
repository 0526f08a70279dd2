"""Metric series from a progress log: rewinds on resume, downsampling, junk lines."""

from __future__ import annotations

import json
from pathlib import Path

from serving.jobs.metrics import downsample, read_series


def _log(path: Path, events: list[dict], junk: bool = True) -> Path:
    lines = []
    for e in events:
        lines.append(json.dumps(e))
        if junk:
            lines.append("2026-12-01 INFO training.trainer: a plain log line")
    lines.append('{"event": "step", "step": 99, "loss": 1.0')  # a line being written
    path.write_text("\n".join(lines))
    return path


def test_series_follow_steps_and_a_resume_rewinds(tmp_path: Path) -> None:
    ev = [{"event": "start", "step": 0, "total_steps": 40}]
    ev += [{"event": "step", "step": s, "loss": 2.0 - s / 100, "lr": 0.1, "eta_s": 40 - s,
            "total_steps": 40} for s in (4, 8, 12, 16)]
    ev += [{"event": "epoch", "step": 16, "val_acc": 0.3, "val_loss": 1.9}]
    # cancelled at 16, resumed from the checkpoint at step 12
    ev += [{"event": "step", "step": s, "loss": 1.0, "lr": 0.05, "eta_s": 40 - s,
            "total_steps": 40} for s in (16, 20)]
    ev += [{"event": "end", "step": 40, "total_steps": 40, "val_acc": 0.5, "val_loss": 1.5}]
    out = read_series(_log(tmp_path / "job.log", ev))
    assert out["series"]["loss"] == [[4, 1.96], [8, 1.92], [12, 1.88], [16, 1.0], [20, 1.0]]
    assert out["series"]["val_acc"] == [[16, 0.3], [40, 0.5]]
    assert out["eta_s"] == 0 and out["step"] == 40 and out["total_steps"] == 40
    assert not out["downsampled"]


def test_downsampling_bounds_every_series(tmp_path: Path) -> None:
    ev = [{"event": "step", "step": s, "loss": float(s), "lr": 1.0, "eta_s": 1.0}
          for s in range(1, 2001)]
    out = read_series(_log(tmp_path / "long.log", ev, junk=False), max_points=100)
    loss = out["series"]["loss"]
    assert len(loss) == 100 and loss[0] == [1, 1.0] and loss[-1] == [2000, 2000.0]
    assert [p[0] for p in loss] == sorted(p[0] for p in loss)
    assert out["downsampled"] and out["points"] == 4000  # loss + lr before downsampling
    assert downsample([[1, 1.0], [2, 2.0]], 5) == [[1, 1.0], [2, 2.0]]


def test_missing_log_gives_empty_series(tmp_path: Path) -> None:
    out = read_series(tmp_path / "none.log")
    assert out["series"] == {} and out["points"] == 0


def test_a_restart_voids_every_series_past_its_checkpoint(tmp_path: Path) -> None:
    ev = [{"event": "start", "step": 0}]
    ev += [{"event": "step", "step": s, "loss": 1.0} for s in (10, 20, 30)]
    ev += [{"event": "epoch", "step": 25, "val_acc": 0.4}]  # evaluated after the checkpoint
    ev += [{"event": "start", "step": 20}]  # resumed from the checkpoint at step 20
    ev += [{"event": "step", "step": 40, "loss": 0.5}]
    out = read_series(_log(tmp_path / "r.log", ev))
    assert out["series"]["loss"] == [[10, 1.0], [20, 1.0], [40, 0.5]]
    assert out["series"]["val_acc"] == []  # the point at 25 belonged to the lost attempt
