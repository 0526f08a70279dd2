"""Training precision and attention path: ``cpu_bf16`` (bf16 training step on a CPU with
native bf16, fp32 validation; a run on a bf16 CPU also records the bf16 accuracy the server
answers with there), ``attention`` (fused / explicit / auto) and the CPU
flag detection behind them."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch

import training.validation
from serving.compiled import trace_forwards
from training.evaluate import evaluate_batches
from training.progress import Progress
from training.recipes import load_recipe
from training.run import prepare_run
from vit_service import hardware
from vit_service.bundle import load_bundle
from vit_service.config import Settings
from vit_service.execution import fused_attention_for, resolve_execution
from vit_service.models import create_model
from vit_service.models.layers import Attention, attention_path
from vit_service.precision import resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
BF16 = torch.bfloat16

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw {extra}
bogomips\t: 5192.28
"""


@pytest.mark.parametrize(("extra", "native"), [("", False), ("avx512_bf16", True),
                                               ("amx_bf16 amx_tile", True),
                                               ("avx512_bf16x", False)])
def test_cpu_flags_name_native_bf16(extra: str, native: bool) -> None:
    flags = hardware.cpu_flags(CPUINFO.format(extra=extra))
    assert {"avx2", "avx512f"} <= flags
    assert any(f in flags for f in hardware.BF16_FLAGS) is native


def test_cpu_flags_without_a_flags_line() -> None:
    assert hardware.cpu_flags("processor : 0\n") == set()


def _recipe(**overrides: object) -> object:
    return load_recipe("cifar10-smoke", {"device": "cpu", **overrides})


def training_precision(recipe: object, device: torch.device
                       ) -> tuple[torch.dtype | None, torch.dtype | None]:
    """Autocast dtypes (training step, reported validation) as a run resolves them."""
    train = resolve_execution("train", device, amp=recipe.amp,  # type: ignore[attr-defined]
                              cpu_bf16=recipe.cpu_bf16)  # type: ignore[attr-defined]
    return train.dtype, resolve_execution("validate", device,
                                          amp=recipe.amp).dtype  # type: ignore[attr-defined]


def test_cpu_bf16_trains_in_bf16_and_validates_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vit_service.execution.cpu_has_native_bf16", lambda: True)
    assert training_precision(_recipe(cpu_bf16=True), CPU) == (BF16, None)
    assert training_precision(_recipe(cpu_bf16=False), CPU) == (None, None)
    # amp is the CUDA switch: it does nothing on the CPU
    assert training_precision(_recipe(amp=True, cpu_bf16=False), CPU) == (None, None)


def test_cpu_bf16_falls_back_to_fp32_without_native_bf16(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("vit_service.execution.cpu_has_native_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="vit_service.execution"):
        assert training_precision(_recipe(cpu_bf16=True), CPU) == (None, None)
    assert "no native bf16" in caplog.text


def test_cuda_amp_covers_training_and_evaluation() -> None:
    assert training_precision(_recipe(amp=True), CUDA) == (BF16, BF16)
    assert training_precision(_recipe(amp=False, cpu_bf16=True), CUDA) == (None, None)


@pytest.mark.parametrize(("choice", "device", "amp", "fused"), [
    ("auto", CPU, BF16, False), ("auto", CPU, None, True), ("auto", CUDA, BF16, True),
    ("fused", CPU, BF16, True), ("explicit", CUDA, None, False),
])
def test_attention_choice(choice: str, device: torch.device, amp: torch.dtype | None,
                          fused: bool) -> None:
    assert fused_attention_for(choice, device.type, amp) is fused


def test_attention_path_restores_each_module() -> None:
    model = create_model("vit_test")
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    attns[0].fused_attn = False
    with attention_path(model, fused=True):
        assert all(m.fused_attn for m in attns)
    assert [m.fused_attn for m in attns] == [False] + [True] * (len(attns) - 1)


def test_unknown_attention_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="attention"):
        _recipe(attention="flash")


def test_cpu_bf16_run_validates_what_the_fp32_bundle_answers(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with ``cpu_bf16`` on a (pretended) bf16 CPU: its steps run under autocast on the
    explicit attention path (EMA copy included), and the validation figure it reports is the
    fp32 accuracy of the bundle it writes, which is what serving loads."""
    monkeypatch.setattr("training.setup.cpu_has_native_bf16", lambda: True)  # the trainer's
    monkeypatch.setattr("vit_service.precision.cpu_has_native_bf16", lambda: False)  # server's
    torch.set_num_threads(1)
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    recipe = load_recipe("cifar10-smoke", {"device": "cpu", "epochs": 1, "cpu_bf16": True,
                                           "attention_samples": 0, "optim.ema_decay": 0.9})
    run = prepare_run(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                      register=False, progress=Progress(json_lines=True, stream=io.StringIO()))
    assert (run.setup.execution.dtype, run.validator.execution().dtype) == (BF16, None)
    assert run.parts.ema is not None
    for model in (run.model, run.parts.ema.module):
        attns = [m for m in model.modules() if isinstance(m, Attention)]
        assert attns and not any(m.fused_attn for m in attns)
    evaluated = []
    real_evaluate = training.validation.evaluate_batches

    def spy(model: torch.nn.Module, *args: object, **kwargs: object) -> object:
        evaluated.append([m.fused_attn for m in model.modules() if isinstance(m, Attention)])
        return real_evaluate(model, *args, **kwargs)

    monkeypatch.setattr("training.validation.evaluate_batches", spy)
    res = run.run()
    assert res.status == "finished" and res.val_acc is not None
    assert evaluated and all(all(flags) for flags in evaluated)  # validation ran fused
    assert not any(m.fused_attn for m in run.model.modules() if isinstance(m, Attention))

    bundle = load_bundle(res.run_dir / "bundle")
    assert all(p.dtype == torch.float32 for p in bundle.model.parameters())
    served = evaluate_batches(bundle.model, run.task.val_batches(64), run.task.forward,
                              run.task.class_names, CPU, None)
    assert served.acc == pytest.approx(res.val_acc, abs=1e-9)
    assert served.loss == pytest.approx(res.val_loss, rel=1e-4)
    assert "val_acc_bf16" not in bundle.meta.extra  # the server answers in fp32 on this CPU


def test_a_run_on_a_bf16_cpu_records_the_accuracy_the_bf16_server_answers_with(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with native bf16 the server answers in bf16 (``inference_precision: auto``):
    the run's bundle carries ``val_acc_bf16``, and it is the accuracy of the served (traced,
    bf16) forward of that bundle on the validation split, to the example."""
    monkeypatch.setattr("vit_service.precision.cpu_has_native_bf16", lambda: True)
    torch.set_num_threads(1)
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    recipe = load_recipe("cifar10-smoke", {"device": "cpu", "epochs": 1,
                                           "attention_samples": 0})
    run = prepare_run(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                      register=False, progress=Progress(json_lines=True, stream=io.StringIO()))
    res = run.run()
    assert res.status == "finished" and res.val_acc is not None
    extra = load_bundle(res.run_dir / "bundle").meta.extra
    assert extra["val_acc"] == pytest.approx(res.val_acc, abs=1e-9)  # fp32, as before

    bundle = load_bundle(res.run_dir / "bundle")
    for p in bundle.model.parameters():  # as the model store loads it
        p.requires_grad_(False)
    fwd = trace_forwards(bundle.model.eval(), "image", bundle.meta.preprocess,
                         precision=resolve_precision("auto"))
    assert fwd.traced and fwd.precision == "bf16"
    correct = n = 0
    with torch.inference_mode():
        for batch in run.task.val_batches(64):
            logits = fwd.plain(*batch.inputs)
            assert logits.dtype == torch.float32
            correct += int((logits.argmax(-1) == batch.labels).sum())
            n += int(batch.labels.numel())
    assert extra["val_acc_bf16"] == pytest.approx(correct / n, abs=1e-9)


@pytest.mark.parametrize(("native", "stop"), [(True, None), (False, None), (True, "max_steps")])
def test_val_precision_served_runs_the_intermediate_passes_as_served(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, native: bool,
        stop: str | None) -> None:
    """``val_precision: served``: the passes before the last run as the server answers on this
    CPU (bf16 autocast on the explicit path where it has native bf16, fp32 on the fused path
    elsewhere); the last pass, the one the run reports and registers, is fp32 on the fused path,
    also when ``max_steps`` ends the run on an epoch boundary. What each pass ran is observed in
    the forward itself, and each figure is recomputed with that forward."""
    monkeypatch.setattr("vit_service.precision.cpu_has_native_bf16", lambda: native)
    torch.set_num_threads(1)
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    overrides: dict[str, object] = {"device": "cpu", "epochs": 3, "eval_every": 1,
                                    "attention_samples": 0, "val_precision": "served"}
    if stop == "max_steps":  # the second epoch's end: its pass is the run's last
        probe = prepare_run(load_recipe("cifar10-smoke", overrides), data_dir=data_dir,
                            settings=settings, mlflow_enabled=False, register=False)
        overrides["max_steps"] = 2 * probe.setup.steps_per_epoch
    run = prepare_run(load_recipe("cifar10-smoke", overrides), data_dir=data_dir,
                      settings=settings, mlflow_enabled=False, register=False,
                      progress=Progress(json_lines=True, stream=io.StringIO()))
    seen: list[tuple[bool, bool]] = []  # per eval-mode forward: (bf16 autocast, fused)
    real_forward = run.task.forward

    def forward(model: torch.nn.Module, batch: object, final: bool = True) -> torch.Tensor:
        if not model.training:
            seen.append((torch.is_autocast_enabled("cpu")
                         and torch.get_autocast_dtype("cpu") == BF16,
                         all(m.fused_attn for m in model.modules() if isinstance(m, Attention))))
        return real_forward(model, batch, final=final)

    passes: list[tuple[set[tuple[bool, bool]], float]] = []
    real_eval = run.evaluate

    def evaluate(final: bool = True) -> object:
        start = len(seen)
        res = real_eval(final=final)
        passes.append((set(seen[start:]), res.acc))
        (bf16, fused), = passes[-1][0]  # one way for the whole pass
        model, correct, n = run.eval_model(), 0, 0
        with torch.inference_mode(), torch.autocast("cpu", BF16, enabled=bf16), \
                attention_path(model, fused=fused):
            for batch in run.task.val_batches(64):
                correct += int((real_forward(model, batch).argmax(-1) == batch.labels).sum())
                n += int(batch.labels.numel())
        assert res.acc == pytest.approx(correct / n, abs=1e-9)
        return res

    monkeypatch.setattr(run.task, "forward", forward)
    monkeypatch.setattr(run, "evaluate", evaluate)
    res = run.run()
    inner, last = {(True, False) if native else (False, True)}, {(False, True)}
    n_passes = 2 if stop == "max_steps" else 3
    assert res.status == ("stopped" if stop else "finished")
    assert [p[0] for p in passes] == [inner] * (n_passes - 1) + [last]
    assert res.val_acc == passes[-1][1]
