"""``vit-service train ... --resume``: repeating the original ``--set`` values is accepted, a
real change of a non-execution key is refused (naming the key and both values)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from training.checkpoint import LAST, save_checkpoint
from training.cli import resume_conflicts
from training.recipes import load_recipe


@pytest.fixture()
def ckpt_recipe() -> dict[str, Any]:
    """What the trainer stores as ``ckpt["recipe"]``: a run started with ``--set epochs=6``."""
    return load_recipe("cifar10-smoke", {"epochs": "6"}).to_dict()


def test_repeated_values_are_not_conflicts(ckpt_recipe: dict[str, Any]) -> None:
    same = {
        "epochs": "6",  # the command line's strings, parsed as --set parses them
        "optim.lr": "3e-3",
        "optim.betas": "[0.9, 0.999]",
        "augment.hflip": "true",
        "data.subset": 400,  # --subset gives an int
        "model.name": "vit_test",
        "model.overrides": "{}",
        "max_steps": "99",  # execution settings may change
        "log_every": "1",
    }
    assert resume_conflicts(ckpt_recipe, same) == []


def test_changes_are_conflicts(ckpt_recipe: dict[str, Any]) -> None:
    changed = resume_conflicts(ckpt_recipe, {
        "epochs": "7", "optim.lr": "1e-3", "augment.hflip": "1", "optim.lrr": "1",
        "threads": "4"})
    assert dict(changed) == {
        "epochs": "the checkpoint has 6, requested 7",
        "optim.lr": "the checkpoint has 0.003, requested 0.001",
        "augment.hflip": "the checkpoint has True, requested 1",  # a bool is not an int
        "optim.lrr": "not in the checkpoint's recipe (requested 1)",
    }


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture()
def cli(tmp_path: Path, ckpt_recipe: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    """``cli(args) -> (rc, stderr, train kwargs or None)`` with a checkpoint of run ``r1`` in a
    private home and the trainer replaced by a stub (no training)."""
    import training.run
    from vit_service.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("VIT_SERVICE_HOME", str(home))
    save_checkpoint(home / "runs" / "r1" / "checkpoints" / LAST,
                    {"recipe": ckpt_recipe, "run_name": "r1", "step": 5})
    calls: list[dict[str, Any]] = []

    class Result:
        exit_code = 0

    def fake_train(recipe: Any, **kw: Any) -> Result:
        calls.append(kw)
        return Result()

    monkeypatch.setattr(training.run, "train", fake_train)

    def run(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, dict | None]:
        capsys.readouterr()
        rc = main(["train", "cifar10-smoke", *args])
        return rc, capsys.readouterr().err, (calls.pop() if calls else None)

    return run


def test_resume_repeating_the_original_command_is_accepted(cli, capsys) -> None:
    rc, err, kw = cli(["--set", "epochs=6", "--set", "log_every=2", "--max-steps", "9",
                       "--resume", "auto", "--run-name", "r1"], capsys)
    assert rc == 0, err
    assert kw is not None and kw["resume"] == "auto" and kw["run_name"] == "r1"
    assert kw["resume_overrides"] == {"max_steps": 9, "log_every": "2"}


def test_resume_with_a_changed_value_is_refused(cli, capsys) -> None:
    rc, err, kw = cli(["--set", "epochs=7", "--set", "optim.lr=3e-3", "--resume", "auto",
                       "--run-name", "r1"], capsys)
    assert rc == 2 and kw is None
    assert "epochs: the checkpoint has 6, requested 7" in err
    assert "optim.lr" not in err  # unchanged: not reported
    assert "Traceback" not in err


def test_resume_execution_keys_need_no_checkpoint_read(cli, capsys) -> None:
    rc, err, kw = cli(["--set", "threads=2", "--resume", "auto", "--run-name", "nope"], capsys)
    assert rc == 0, err  # the trainer (stubbed here) finds, or misses, the checkpoint
    assert kw is not None and kw["resume_overrides"] == {"threads": "2"}
    rc, err, kw = cli(["--set", "epochs=6", "--resume", "auto", "--run-name", "nope"], capsys)
    assert rc == 2 and kw is None and "no checkpoint for run 'nope'" in err


def test_resume_if_exists_resumes_a_run_with_a_checkpoint_else_starts_afresh(cli, capsys) -> None:
    rc, err, kw = cli(["--set", "epochs=6", "--resume", "if-exists", "--run-name", "r1"], capsys)
    assert rc == 0, err
    assert kw is not None and kw["resume"] == "auto"  # r1 has a checkpoint
    rc, err, kw = cli(["--set", "epochs=7", "--resume", "if-exists", "--run-name", "new"],
                      capsys)
    assert rc == 0, err
    assert kw is not None and kw["resume"] is None and kw["resume_overrides"] == {}
    rc, err, kw = cli(["--set", "epochs=7", "--resume", "if-exists", "--run-name", "r1"],
                      capsys)
    assert rc == 2 and "epochs: the checkpoint has 6, requested 7" in err  # still checked
    rc, err, kw = cli(["--resume", "if-exists"], capsys)
    assert rc == 2 and kw is None and "--resume if-exists needs --run-name" in err
