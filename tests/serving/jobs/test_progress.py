"""Folding the trainer's JSON-lines events into a job's progress."""

from __future__ import annotations

from serving.jobs.progress import merge_progress


def test_a_budget_re_plan_updates_the_epochs() -> None:
    p: dict = {}
    merge_progress(p, {"event": "start", "total_steps": 350, "epochs": 10,
                       "steps_per_epoch": 35})
    assert (p["epochs"], p["total_steps"]) == (10, 350)
    # the budget measured the throughput and planned 4,498 steps: 129 epochs of 35
    merge_progress(p, {"event": "step", "step": 40, "epoch": 1, "total_steps": 4498,
                       "loss": 0.9})
    assert p["epochs"] == 129 and p["total_steps"] == 4498 and p["metrics"]["loss"] == 0.9
    merge_progress(p, {"event": "end", "status": "finished", "step": 4498})
    assert p["status"] == "finished" and p["last_event"] == "end"


def test_progress_without_a_schedule_is_left_as_sent() -> None:
    p: dict = {}
    merge_progress(p, {"event": "start", "epochs": 3})
    assert p["epochs"] == 3 and "total_steps" not in p
