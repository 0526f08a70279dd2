"""The trainer's GPU code paths, exercised on the CPU (no GPU in CI): bf16 autocast in
``train_step`` and through a whole run, ``torch.compile`` of the training forward, and DDP with
``torchrun`` on Gloo. Tiny models (vit_test / text_test) on generated data."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.conftest import QUIET, REPO, mlflow_client, progress_events
from training.checkpoint import load_checkpoint
from training.distributed import DistInfo
from training.evaluate import evaluate_batches
from training.model_setup import build_task_model
from training.optim import build_optimizer
from training.progress import Progress
from training.recipes import load_recipe
from training.run import prepare_run, train
from training.step import train_step
from training.tasks import build_task
from vit_service.config import Settings
from vit_service.hardware import has_cxx_compiler

CPU = DistInfo(device=torch.device("cpu"))
BF16 = torch.bfloat16

# (recipe, overrides): the image and text classifiers, the conv-stem / mean-pool / flip-TTA ViT
# of the GPU recipe, and the MLM objective
CASES = {
    "vit": ("cifar10-smoke", {}),
    "vit-conv-stem": ("cifar10-smoke", {"model.overrides": {
        "stem": "conv", "stem_width": 8, "patch_size": 4, "pool": "mean", "tta_flip": True}}),
    "text": ("imdb-smoke", {}),
    "mlm": ("imdb-mlm-smoke", {}),
}


def _setup(case: str, data_dir: Path) -> tuple[Any, Any, torch.nn.Module]:
    name, overrides = CASES[case]
    recipe = load_recipe(name, {"device": "cpu", **overrides})
    task = build_task(recipe, CPU, data_dir, data_dir.parent / "cache")
    torch.manual_seed(0)
    return recipe, task, build_task_model(recipe, task)


def _optimizer(recipe: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = recipe.optim
    return build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.layer_decay,
                           fused=False)


@pytest.mark.parametrize("case", list(CASES))
def test_train_step_under_bf16_autocast_on_cpu(case: str, data_dir: Path) -> None:
    torch.set_num_threads(1)
    recipe, task, model = _setup(case, data_dir)
    ref = copy.deepcopy(model)
    batch = task.train_batch(0, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    loss32, _, _ = train_step(ref, ref, task, batch, _optimizer(recipe, ref), 1.0, None)
    loss, logits, gnorm = train_step(model, model, task, batch, _optimizer(recipe, model), 1.0,
                                     BF16)

    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert gnorm is not None and torch.isfinite(gnorm)
    if task.objective == "classify":
        assert logits is not None and logits.dtype == BF16  # autocast really was on
    else:
        assert logits is None
    # bf16 matmuls: the same loss as fp32 to bf16 precision (8 bits of mantissa)
    assert float(loss) == pytest.approx(float(loss32), rel=3e-2)
    changed = [n for n, p in model.named_parameters()
               if p.requires_grad and not torch.equal(p.detach(), before[n])]
    assert len(changed) >= 0.9 * len(before), "most parameters should move after one step"
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all()
               for p in model.parameters())  # master weights stay fp32
    for _ in range(2):  # a few more steps stay finite
        loss, _, _ = train_step(model, model, task, task.train_batch(0, 1), _optimizer(
            recipe, model), 1.0, BF16)
        assert torch.isfinite(loss)
    if task.objective == "classify":  # the evaluation path under autocast
        res = evaluate_batches(model, task.val_batches(64), task.forward, task.class_names,
                               CPU.device, BF16)
        assert 0.0 <= res.acc <= 1.0 and res.loss == res.loss


@pytest.mark.parametrize("name", ["cifar10-smoke", "imdb-mlm-smoke"])
def test_whole_run_with_bf16_autocast_on_cpu(name: str, tmp_path: Path, data_dir: Path) -> None:
    """The trainer only enables bf16 on CUDA; forced on here, a whole run (steps, EMA, per-epoch
    evaluation or MLM validation under autocast, checkpoint, bundle) works on the CPU."""
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    run = prepare_run(load_recipe(name, {"device": "cpu", "epochs": 1, "attention_samples": 0}),
                      data_dir=data_dir, settings=settings, mlflow_enabled=False,
                      register=False, progress=Progress(json_lines=True, stream=io.StringIO()))
    run.setup.execution = dataclasses.replace(run.setup.execution, dtype=BF16)
    res = run.run()
    assert res.status == "finished" and res.step == run.setup.steps_per_epoch
    assert res.val_loss is not None and 0 < res.val_loss < 20
    assert res.val_acc is None if run.recipe.pretraining else 0 <= res.val_acc <= 1
    assert (res.run_dir / "bundle" / "weights.pt").is_file()


def test_the_trainer_takes_fused_adamw_on_the_cpu_too(tmp_path: Path, data_dir: Path) -> None:
    """One kernel over all the parameters: 1.3 ms against 6.6 ms per step for the foreach
    implementation on vit_nano_convstem_32 (docs/training.md); the CUDA path asks the same."""
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    run = prepare_run(load_recipe("cifar10-smoke", {"device": "cpu", "attention_samples": 0}),
                      data_dir=data_dir, settings=settings, mlflow_enabled=False,
                      register=False, progress=Progress(json_lines=True, stream=io.StringIO()))
    assert run.parts.optimizer.defaults["fused"] is True
    assert run.parts.optimizer.defaults["foreach"] is not True


def _step_losses(stream: io.StringIO) -> list[float]:
    return [e["loss"] for e in progress_events(stream.getvalue()) if e["event"] == "step"]


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile (inductor) on the CPU needs "
                    "a C++ compiler (g++/c++/clang++), none on PATH")
def test_compiled_training_matches_eager_on_cpu(tmp_path: Path, data_dir: Path) -> None:
    """``compile: true``: the trainer wraps the model in ``torch.compile`` (inductor, C++ on the
    CPU). Same seed, same batches: the compiled run's losses equal the eager run's."""
    torch.set_num_threads(1)
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    from torch._dynamo.utils import counters

    losses = {}
    for compiled in (False, True):
        counters.clear()
        stream = io.StringIO()
        recipe = load_recipe("cifar10-smoke", {
            "device": "cpu", "compile": compiled, "max_steps": 3, "log_every": 1,
            "attention_samples": 0, "model.overrides": {"depth": 1}})
        res = train(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                    register=False, run_name=f"compile-{compiled}",
                    progress=Progress(json_lines=True, stream=stream))
        assert res.status == "stopped" and res.step == 3
        # dynamo traced (and inductor compiled) the forward only when asked
        assert bool(counters["stats"]["unique_graphs"]) == compiled
        losses[compiled] = _step_losses(stream)
    eager, comp = losses[False], losses[True]
    assert len(eager) == len(comp) == 3 and all(map(torch.isfinite, torch.tensor(comp)))
    assert comp[0] == pytest.approx(eager[0], rel=1e-4)  # step 0: same weights, same batch
    assert comp == pytest.approx(eager, rel=1e-2)


def test_compile_without_a_cxx_compiler_trains_eager(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A recipe that ships ``compile: true`` (cifar10-vit-convstem-cpu) still trains on a CPU
    machine without g++/clang++: a warning, then the eager step (dynamo never traces)."""
    from torch._dynamo.utils import counters

    import training.setup as setup_mod

    monkeypatch.setattr(setup_mod, "has_cxx_compiler", lambda: False)
    counters.clear()
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    recipe = load_recipe("cifar10-smoke", {
        "device": "cpu", "compile": True, "max_steps": 2, "log_every": 1,
        "attention_samples": 0, "model.overrides": {"depth": 1}})
    with caplog.at_level("WARNING", logger="training.setup"):
        res = train(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                    register=False, run_name="no-cxx", progress=Progress(stream=io.StringIO()))
    assert res.status == "stopped" and res.step == 2
    assert "needs a C++ compiler" in caplog.text
    assert not counters["stats"]["unique_graphs"]


def test_ddp_on_gloo_with_torchrun(tmp_path: Path, data_dir: Path, mlflow_db) -> None:
    """``torchrun --standalone --nproc_per_node 2 -m vit_service.cli train cifar10-smoke``: two
    CPU ranks on Gloo, one thread each, one epoch; rank 0 alone reports; the run finishes."""
    home = tmp_path / "home"
    uri = mlflow_db(home)
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, **QUIET,
           "VIT_SERVICE_HOME": str(home), "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache"),
           "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "vit_service.cli", "train", "cifar10-smoke", "--data-dir", str(data_dir),
           "--device", "cpu", "--set", "threads=1", "--set", "epochs=1",
           "--set", "attention_samples=0", "--run-name", "ddp", "--no-register"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    events = progress_events(proc.stdout)
    assert [e["event"] for e in events].count("start") == 1  # only rank 0 prints progress
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "finished"
    assert end["step"] == end["total_steps"] == 12  # 400 images / global batch 32
    step = next(e for e in events if e["event"] == "step")
    assert step["throughput"] > 0
    ck = load_checkpoint(home / "runs" / "ddp" / "checkpoints" / "last.pt")
    assert ck["world_size"] == 2 and len(ck["rng"]) == 2 and ck["status"] == "finished"
    run = mlflow_client(uri).get_run(end["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.world_size"] == "2"
    assert json.loads((home / "runs" / "ddp" / "run.json").read_text())["run_name"] == "ddp"


def test_gpu_recipes_build_and_train_on_cpu_in_miniature(tmp_path: Path, data_dir: Path) -> None:
    """cifar10-vit, imdb-mlm-pretrain-gpu and imdb-transformer as written (architecture,
    whitening + mimetic init, conv stem, TTA, head+tail truncation), shrunk to a few steps on
    the generated data: they build, train, publish, and the fine-tuning recipe loads the
    pretraining recipe's encoder."""
    torch.set_num_threads(1)
    settings = Settings(home=tmp_path / "home", cache_dir=data_dir.parent / "cache")
    small = {"device": "cpu", "compile": False, "budget_minutes": None, "epochs": 1,
             "max_steps": 2, "batch_size": 8, "eval_batch_size": 64, "attention_samples": 2,
             "data.subset": 64}

    def run(name: str, **extra: Any) -> Any:
        recipe = load_recipe(name, {**small, **extra})
        return train(recipe, data_dir=data_dir, settings=settings, mlflow_enabled=False,
                     register=False, run_name=name,
                     progress=Progress(json_lines=True, stream=io.StringIO()))

    vit = run("cifar10-vit", **{"data.val_size": 50})
    assert vit.status == "stopped" and 0 <= vit.val_acc <= 1
    mlm = run("imdb-mlm-pretrain-gpu", **{"data.val_size": 40, "data.max_len": 64})
    assert mlm.status == "stopped" and mlm.val_loss > 0
    ft = run("imdb-transformer", **{"data.val_size": 40, "data.max_len": 64,
                                    "init.from": str(mlm.run_dir / "bundle")})
    assert ft.status == "stopped" and 0 <= ft.val_acc <= 1
    meta = json.loads((ft.run_dir / "bundle" / "meta.json").read_text())
    assert meta["extra"]["lineage"]["parent_recipe"] == "imdb-mlm-pretrain-gpu"
    assert meta["preprocess"]["truncation"] == "head_tail"
