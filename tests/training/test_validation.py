"""``training.validation``: which views each validation pass of a run sees."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from training.progress import Progress
from training.recipes import load_recipe
from training.run import prepare_run
from vit_service.config import Settings
from vit_service.tta import predict


def test_intermediate_passes_leave_out_the_shifted_views_and_the_last_has_them(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``tta_shift`` model: the passes that only draw the curve average the flip pair (a
    third of the cost), the last pass, the one the run reports, all six views as served. Each
    pass's accuracy is recomputed with the views it should have used."""
    torch.set_num_threads(1)
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    recipe = load_recipe("cifar10-smoke", {
        "device": "cpu", "epochs": 3, "eval_every": 1, "attention_samples": 0,
        "model.overrides": {"tta_flip": True, "tta_shift": True, "pool": "mean"}})
    run = prepare_run(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                      register=False, progress=Progress(json_lines=True, stream=io.StringIO()))
    passes: list[tuple[bool, float]] = []
    real_eval = run.evaluate

    def evaluate(final: bool = True) -> object:
        res = real_eval(final=final)
        model, correct, n = run.eval_model(), 0, 0
        with torch.inference_mode():
            for batch in run.task.val_batches(64):
                x = batch.inputs[0]
                correct += int((predict(model, x, shift=final).argmax(-1)
                                == batch.labels).sum())
                n += int(batch.labels.numel())
                got = run.task.forward(model, batch, final=final)
                torch.testing.assert_close(got, predict(model, x, shift=final))
                other = run.task.forward(model, batch, final=not final)
                assert not torch.allclose(got, other, atol=1e-6)  # the views differ
        assert res.acc == pytest.approx(correct / n, abs=1e-9)
        passes.append((final, res.acc))
        return res

    monkeypatch.setattr(run, "evaluate", evaluate)
    res = run.run()
    assert [final for final, _ in passes] == [False, False, True]
    assert res.val_acc == passes[-1][1]


@pytest.mark.parametrize("shift", [False, True])
def test_the_end_is_timed_again_only_where_the_last_pass_differs_from_the_intermediate_one(
        tmp_path: Path, data_dir: Path, shift: bool) -> None:
    """Budget mode's start-up probe: a last pass run like the intermediate one takes the
    intermediate pass's estimate; one with the shifted views (which the intermediate passes
    leave out) is timed itself. The pass as served is timed where the run records it."""
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    recipe = load_recipe("cifar10-smoke", {
        "device": "cpu", "epochs": 1, "attention_samples": 0,
        "model.overrides": {"tta_flip": True, "tta_shift": shift, "pool": "mean"}})
    run = prepare_run(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                      register=False, progress=Progress(json_lines=True, stream=io.StringIO()))
    v = run.validator
    timed: list[tuple[bool, bool]] = []

    def time_pass(model: torch.nn.Module, final: bool = True, served: bool = False) -> float:
        timed.append((final, served))
        return 5.0

    v.time_pass = time_pass  # type: ignore[method-assign]
    end = v.time_end(run.eval_model(), 3.0)
    served = [(True, True)] if v.records_bf16_val else []
    assert timed == ([(True, False)] if shift else []) + served
    assert end == (5.0 if shift else 3.0) + (5.0 if served else 0.0)
