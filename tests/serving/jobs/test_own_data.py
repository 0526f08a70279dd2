"""Your own data end to end, as the README walks it: upload an image set and a text set, train
the generic recipes on them through the jobs API (a real `vit-service serve` process, real
`vit-service train` jobs, real SQLite MLflow), and predict with the models they register, which
the server discovers by their ``@champion`` alias. The sets are made by ``examples/own_data.py``
from generated archives in the real CIFAR-10 and IMDb layouts."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from examples.own_data import image_subset, star_table
from tests.serving.jobs.test_jobs_api import _follow
from tests.serving.procs import Server
from tests.training.conftest import make_cifar_archive, make_imdb_archive, mlflow_client

PETS = ["airplane", "automobile", "bird"]
KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("own-data")
    home = root / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "MLFLOW_", "RAY_"))}
    env.update({
        "VIT_SERVICE_HOME": str(home), "VIT_SERVICE_DATA_DIR": str(root / "no-data"),
        "VIT_SERVICE_CACHE_DIR": str(root / "cache"), "VIT_SERVICE_API_KEY": KEY,
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "VIT_SERVICE_JOBS_POLL_S": "0.2",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "LOG_LEVEL": "WARNING",
    })
    # the registry is polled every second, so a new champion is served soon after its job
    s = Server(env, home, args=("--workers", "1", "--reload-interval", "1"))
    s.start()
    yield s
    s.stop()


def _upload(server: Server, path: Path, ctype: str) -> dict:
    r = server.post(f"/v1/datasets?name={path.name}", content=path.read_bytes(),
                    headers={"Content-Type": ctype})
    assert r.status_code == 201, r.text
    return r.json()


def _served(server: Server, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = {m["name"]: m for m in server.get("/v1/models").json()["models"]}
        if models.get(name, {}).get("loaded"):
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} not served: {server.get('/v1/models').json()}")


def _dataset_input(uri: str, run_id: str) -> dict[str, str]:
    run = mlflow_client(uri).get_run(run_id)
    (inp,) = run.inputs.dataset_inputs
    return {"digest": inp.dataset.digest, "name": inp.dataset.name,
            **{t.key: t.value for t in inp.tags}}


def test_an_image_set_uploaded_trained_served_and_explained(server: Server, tmp_path: Path
                                                            ) -> None:
    archive = make_cifar_archive(tmp_path / "cifar.tar.gz", per_class=40)
    zipped = image_subset(archive, tmp_path / "pets.zip", PETS, per_class=30, val_per_class=10)
    d = _upload(server, zipped, "application/zip")
    assert d["kind"] == "image" and d["classes"] == PETS
    assert d["counts"] == {"train": dict.fromkeys(PETS, 30), "val": dict.fromkeys(PETS, 10)}

    # the recipe as shipped (conv stem, compile, bf16 where the CPU has it), a few steps
    r = server.post("/v1/jobs", json={"recipe": "image-classifier-cpu", "overrides": {
        "data.dataset": d["id"], "register_as": "my-pets", "budget_minutes": None,
        "epochs": 3, "batch_size": 32}})
    assert r.status_code == 202, r.text
    done = _follow(server, r.json()["id"], {"succeeded"}, timeout=420)
    assert 0.0 <= done["progress"]["metrics"]["val_acc"] <= 1.0
    uri = server.env["MLFLOW_TRACKING_URI"]
    versions = mlflow_client(uri).search_model_versions(f"run_id='{done['mlflow_run_id']}'")
    assert [v.name for v in versions] == ["my-pets"]
    inp = _dataset_input(uri, done["mlflow_run_id"])  # the run points at the exact data
    assert inp["digest"] == d["sha256"][:32] and inp["dataset_id"] == d["id"]

    _served(server, "my-pets")
    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 30, 30)).save(buf, "PNG")
    p = server.post("/v1/predict/image?model=my-pets&attention=rollout&attention=heads",
                    content=buf.getvalue(), headers={"Content-Type": "image/png"})
    assert p.status_code == 200, p.text
    res = p.json()["results"][0]
    assert {x["label"] for x in res["predictions"]} == set(PETS)
    assert res["attention"]["rollout"] and res["attention"]["heads"]
    card = server.get("/v1/models/my-pets/card").json()
    assert card["classes"] == PETS and card["recipe"] == "image-classifier-cpu"
    assert card["val_acc"] == pytest.approx(done["progress"]["metrics"]["val_acc"])


def test_a_text_set_labelled_by_stars(server: Server, tmp_path: Path) -> None:
    archive = make_imdb_archive(tmp_path / "imdb.tar.gz", per_class=60)
    table = star_table(archive, tmp_path / "stars.csv")
    d = _upload(server, table, "text/csv")
    assert d["kind"] == "text" and d["classes"] == ["1-2", "3-4", "7-8", "9-10"]

    r = server.post("/v1/jobs", json={"recipe": "text-classifier-cpu", "overrides": {
        "data.dataset": d["id"], "register_as": "my-stars", "epochs": 1, "batch_size": 16,
        "data.vocab_size": 200, "data.max_len": 64}})
    assert r.status_code == 202, r.text
    job = r.json()
    # a data set a job is using cannot be deleted
    gone = server.delete(f"/v1/datasets/{d['id']}")
    assert gone.status_code == 409 and job["id"] in gone.text
    done = _follow(server, job["id"], {"succeeded"}, timeout=300)
    uri = server.env["MLFLOW_TRACKING_URI"]
    assert _dataset_input(uri, done["mlflow_run_id"])["digest"] == d["sha256"][:32]

    _served(server, "my-stars")
    p = server.post("/v1/predict/text", json={
        "text": "awful boring film", "model": "my-stars", "top_k": 4, "attention": "rollout"})
    assert p.status_code == 200, p.text
    res = p.json()["results"][0]
    assert {x["label"] for x in res["predictions"]} == set(d["classes"])
    assert res["attention"]["rollout"]
    assert server.delete(f"/v1/datasets/{d['id']}").status_code == 204  # the job is done


@pytest.mark.parametrize("overrides, needle", [
    ({}, "give its id as data.dataset"),
    ({"data.dataset": "0123456789abcdef"}, "unknown data set"),
    ({"data.dataset": "../../etc"}, "dataset"),
    ({"data.dataset": "cifar10", "register_as": "mine"}, "register_as"),
    ({"register_as": "cifar10-vit"}, "built-in model's name"),
    ({"register_as": "../escape"}, "register_as"),
])
def test_bad_jobs_on_own_data_are_422(server: Server, overrides: dict, needle: str) -> None:
    r = server.post("/v1/jobs", json={"recipe": "image-classifier-cpu", "overrides": overrides})
    assert r.status_code == 422, r.text
    assert needle in r.text


def test_a_data_set_of_the_other_kind_is_422(server: Server, tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("text,label\n" + "".join(f"row {i},{'ab'[i % 2]}\n" for i in range(20)))
    d = _upload(server, table, "text/csv")
    r = server.post("/v1/jobs", json={"recipe": "image-classifier-cpu",
                                      "overrides": {"data.dataset": d["id"]}})
    assert r.status_code == 422 and "holds texts" in r.text
