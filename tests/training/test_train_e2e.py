"""End to end on generated data in the real formats: the real CLI in subprocesses (image and
text smoke recipes, SIGTERM) and in-process runs (resume, champion, evaluate)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.training.conftest import QUIET, REPO, mlflow_client, progress_events, run_artifacts
from training.checkpoint import LAST, load_checkpoint
from training.recipes import load_recipe
from training.run import train
from training.signals import EXIT_SIGTERM
from vit_service.config import Settings
from vit_service.hardware import cpu_flags, cpu_has_native_bf16, cpu_model


@pytest.fixture(scope="module")
def image_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, run_cli,
              mlflow_db) -> dict:
    """`vit-service train cifar10-smoke` through the real CLI, once for this module."""
    home = tmp_path_factory.mktemp("image-home")
    env = {"VIT_SERVICE_HOME": str(home), "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache"),
           **QUIET}
    uri = mlflow_db(home)
    proc = run_cli(["train", "cifar10-smoke", "--data-dir", str(data_dir), "--tracking-uri", uri,
                    "--run-name", "smoke-1"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"proc": proc, "uri": uri, "home": home, "env": env}


def test_image_cli_run_progress_is_json_lines(image_run: dict) -> None:
    events = progress_events(image_run["proc"].stdout)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds.count("epoch") == 2 and "step" in kinds
    step = next(e for e in events if e["event"] == "step")
    assert {"epoch", "step", "total_steps", "loss", "lr", "throughput", "mlflow_run_id"} <= set(
        step)
    end = events[-1]
    assert end["status"] == "finished" and end["step"] == end["total_steps"] == 24
    assert end["registered_version"] == "1"
    assert image_run["proc"].stdout.splitlines() == [
        ln for ln in image_run["proc"].stdout.splitlines() if ln.startswith("{")]  # no stray text


def test_image_cli_run_is_in_mlflow(image_run: dict) -> None:
    client = mlflow_client(image_run["uri"])
    run_id = progress_events(image_run["proc"].stdout)[0]["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "smoke-1"
    assert client.get_experiment(run.info.experiment_id).name == "cifar10"
    p = run.data.params
    assert p["recipe.optim.lr"] == "0.003" and p["recipe.model.pos_encoding"] == "learned"
    assert p["model.embed_dim"] == "32" and p["data.n_train"] == "400"
    # the machine the figures came from, and the rate it trained at
    assert p["machine.cpu"] == cpu_model() and int(p["machine.cpu_count"]) >= 1
    assert p["machine.native_bf16"] == str(cpu_has_native_bf16())
    assert p["machine.avx512"] == str("avx512f" in cpu_flags())
    assert float(p["train.steps_per_s"]) > 0
    m = run.data.metrics
    assert {"train/loss", "train/lr", "train/throughput", "train/data_time_frac", "val/loss",
            "val/acc", "val_acc", "val/class_acc/airplane"} <= set(m)
    assert m["val_acc"] > 0.5  # the generated classes are easy
    assert len(client.get_metric_history(run_id, "val_acc")) == 2  # per epoch
    arts = run_artifacts(client, run_id)
    assert {"recipe.yaml", "confusion_matrix.png", "per_class.json",
            "attention/attention_rollout.png"} <= arts
    mv = client.get_model_version_by_alias("cifar10-vit", "champion")
    assert str(mv.version) == "1" and mv.run_id == run_id
    run_dir = image_run["home"] / "runs" / "smoke-1"
    assert (run_dir / "checkpoints" / LAST).is_file() and (run_dir / "bundle/meta.json").is_file()
    assert (run_dir / "train.log").is_file() and (run_dir / "recipe.yaml").is_file()


def test_worse_run_does_not_move_champion_and_evaluate(image_run: dict, data_dir: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    from vit_service.cli import main

    settings = Settings(home=image_run["home"], cache_dir=data_dir.parent / "cache")
    worse = load_recipe("cifar10-smoke", {"optim.lr": "1e-9", "epochs": 1})
    res = train(worse, data_dir=data_dir, run_name="smoke-worse", settings=settings,
                tracking_uri=image_run["uri"])
    assert res.registered_version == "2"
    client = mlflow_client(image_run["uri"])
    assert str(client.get_model_version_by_alias("cifar10-vit", "champion").version) == "1"
    first = client.get_run(client.get_model_version("cifar10-vit", "1").run_id)

    # evaluate the champion on the recomputed val split: same accuracy as in training
    capsys.readouterr()
    rc = main(["evaluate", "cifar10-vit", "--split", "val", "--data-dir", str(data_dir),
               "--tracking-uri", image_run["uri"]])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"accuracy {first.data.metrics['val_acc']:.4f} on 100 examples" in out
    assert "airplane" in out and "precision" in out
    rc = main(["evaluate", str(image_run["home"] / "runs/smoke-1/bundle"), "--split", "test",
               "--data-dir", str(data_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "'test' split is not present" in err


def test_a_run_scored_on_a_smaller_split_is_not_promoted(image_run: dict,
                                                          data_dir: Path) -> None:
    """A run with its own ``data.val_size`` is registered with its split's fingerprint and
    does not become champion (the decision itself: tests/vit_service/test_promotion.py)."""
    settings = Settings(home=image_run["home"], cache_dir=data_dir.parent / "cache")
    client = mlflow_client(image_run["uri"])
    before = str(client.get_model_version_by_alias("cifar10-vit", "champion").version)
    gamed = load_recipe("cifar10-smoke", {"data.val_size": 10, "epochs": 1})
    res = train(gamed, data_dir=data_dir, run_name="smoke-gamed", settings=settings,
                tracking_uri=image_run["uri"])
    run = client.get_run(client.get_model_version("cifar10-vit", res.registered_version).run_id)
    champ = client.get_run(client.get_model_version_by_alias("cifar10-vit", "champion").run_id)
    assert run.data.params["eval.split_fingerprint"] != champ.data.params[
        "eval.split_fingerprint"]
    assert str(client.get_model_version_by_alias("cifar10-vit", "champion").version) == before
    assert run.data.tags["vit_service.champion"] == "false"


def test_text_cli_run_end_to_end(tmp_path: Path, data_dir: Path, run_cli, mlflow_db) -> None:
    uri = mlflow_db(tmp_path)
    env = {"VIT_SERVICE_HOME": str(tmp_path / "home"), **QUIET,
           "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache")}
    proc = run_cli(["train", "imdb-smoke", "--data-dir", str(data_dir), "--tracking-uri", uri],
                   env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = progress_events(proc.stdout)
    assert events[-1]["status"] == "finished" and events[-1]["registered_version"] == "1"
    step = next(e for e in events if e["event"] == "step")
    assert step["throughput"] > 0  # tokens/s
    client = mlflow_client(uri)
    run_id = events[0]["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.data.params["recipe.data.max_len"] == "64"
    assert client.get_experiment(run.info.experiment_id).name == "imdb"
    assert {"val_acc", "train/loss", "val/loss"} <= set(run.data.metrics)
    arts = run_artifacts(client, run_id)
    assert {"recipe.yaml", "confusion_matrix.png", "attention/attention_rollout.html"} <= arts
    assert str(client.get_model_version_by_alias("imdb-sentiment", "champion").version) == "1"
    bundle = next((tmp_path / "home" / "runs").glob("imdb-smoke-*/bundle"))
    assert (bundle / "tokenizer.json").is_file()
    from vit_service.bundle import load_bundle

    b = load_bundle(bundle)
    assert b.meta.task == "text" and b.meta.preprocess == {"max_len": 64, "truncation": "head"}
    assert b.meta.extra["recipe"]["name"] == "imdb-smoke"
    enc = b.tokenizer.encode_batch(["a great wonderful film"], 64)
    assert b.model(enc.input_ids, enc.attention_mask).shape == (1, 2)
    # `vit-service evaluate` on the rebuilt validation split (length-sorted batches) scores
    # what the run logged
    from training.evaluate import evaluate_bundle

    ev = evaluate_bundle(str(bundle), "val", data_dir, cache_dir=data_dir.parent / "cache",
                         batch_size=7)
    assert ev.n == 40  # the recipe's data.val_size
    # (the same on CPU; a CUDA run validated in bf16 may differ by a review)
    assert ev.acc == pytest.approx(run.data.metrics["val_acc"],
                                   abs=1.5 / 40 if torch.cuda.is_available() else 1e-6)


def test_resume_equals_uninterrupted_run(env: dict, data_dir: Path) -> None:
    settings = Settings()
    recipe = load_recipe("cifar10-smoke")  # 2 epochs x 12 steps, CutMix/Mixup, EMA, dropout-free
    straight = train(recipe, data_dir=data_dir, run_name="straight", settings=settings,
                     mlflow_enabled=False)
    assert straight.status == "finished" and straight.step == 24

    cut = load_recipe("cifar10-smoke", {"max_steps": 17})  # stop mid-way through epoch 2
    first = train(cut, data_dir=data_dir, run_name="cut", settings=settings, register=False)
    assert first.status == "stopped" and first.step == 17
    mid = load_checkpoint(first.checkpoint)
    assert (mid["step"], mid["epoch"], mid["batch_in_epoch"]) == (17, 1, 5)

    resumed = train(recipe, data_dir=data_dir, resume="auto", run_name="cut", settings=settings,
                    resume_overrides={"max_steps": None}, register=False)  # to the end
    assert resumed.status == "finished" and resumed.step == 24
    assert resumed.mlflow_run_id == first.mlflow_run_id  # the same MLflow run continues

    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(resumed.checkpoint)
    for part in ("model", "ema"):
        sa, sb = (a[part] if part == "model" else a[part]["module"]), \
            (b[part] if part == "model" else b[part]["module"])
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=0, msg=f"{part}.{k}")
    assert a["optimizer"]["state"][0]["step"] == b["optimizer"]["state"][0]["step"]
    assert resumed.val_acc == straight.val_acc
    assert resumed.val_loss == pytest.approx(straight.val_loss, abs=1e-6)
    client = mlflow_client(env["MLFLOW_TRACKING_URI"])
    hist = client.get_metric_history(first.mlflow_run_id, "train/loss")
    assert max(h.step for h in hist) == 24


def test_sigterm_checkpoints_and_exits_143(tmp_path: Path, data_dir: Path, mlflow_db) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "VIT_SERVICE_HOME": str(home), **QUIET,
           "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache"),
           "MLFLOW_TRACKING_URI": mlflow_db(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vit_service.cli", "train", "cifar10-smoke", "--data-dir",
         str(data_dir), "--set", "epochs=500", "--run-name", "killed", "--no-register"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until training is under way
            if json.loads(line)["event"] == "step":
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_SIGTERM, err[-3000:]
    end = progress_events(out)[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["exit_code"] == 143
    state = load_checkpoint(home / "runs" / "killed" / "checkpoints" / LAST)  # weights_only
    assert state["status"] == "interrupted" and 4 <= state["step"] < 500 * 12
    assert state["step"] == end["step"]
    assert not list((home / "runs" / "killed" / "checkpoints").glob(".*tmp"))
    run = mlflow_client(env["MLFLOW_TRACKING_URI"]).get_run(state["mlflow_run_id"])
    assert run.info.status == "KILLED"


def test_missing_data_is_a_clear_error_with_exit_code_2(
        env: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vit_service.cli import main

    rc = main(["train", "cifar10-smoke", "--data-dir", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2 and "No CIFAR-10 data found" in err and "Traceback" not in err
    rc = main(["train", "cifar10-smoke", "--set", "optim.lrr=1"])
    assert rc == 2 and "optim.lrr: unknown key" in capsys.readouterr().err


def test_eval_every_skips_intermediate_validation_but_not_the_last(
        tmp_path: Path, data_dir: Path, run_cli, mlflow_db) -> None:
    uri = mlflow_db(tmp_path)
    env = {"VIT_SERVICE_HOME": str(tmp_path / "home"), **QUIET,
           "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache")}
    proc = run_cli(["train", "cifar10-smoke", "--data-dir", str(data_dir), "--tracking-uri", uri,
                    "--no-register", "--set", "epochs=3", "--set", "eval_every=2"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = progress_events(proc.stdout)
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert ["val_acc" in e for e in epochs] == [False, True, True]  # 2nd, and the last
    assert events[-1]["val_acc"] == epochs[-1]["val_acc"]
    history = mlflow_client(uri).get_metric_history(events[0]["mlflow_run_id"], "val/acc")
    assert [m.step for m in history] == [epochs[1]["step"], epochs[2]["step"]]
