"""The registered models also work as MLflow pyfuncs (what ``mlflow models serve`` runs)."""

import base64

import mlflow
import pandas as pd

from vit_service import tracking


def test_image_pyfunc_matches_the_api(client, image_bytes) -> None:
    img = image_bytes(seed=11)
    model = mlflow.pyfunc.load_model("models:/cifar10-vit@champion")
    out = model.predict(pd.DataFrame({"image": [base64.b64encode(img).decode()] * 2}))
    assert list(out.columns) == ["label", "index", "probability"] and len(out) == 2
    api = client.post("/v1/predict/image", content=img, headers={"content-type": "image/png"},
                      params={"top_k": 1, "attention": "none"}).json()["results"][0]
    top = api["predictions"][0]
    assert out["index"][0] == top["index"] and out["label"][0] == top["label"]
    assert abs(out["probability"][0] - top["probability"]) < 1e-5


def test_text_pyfunc(client) -> None:
    model = mlflow.pyfunc.load_model("models:/imdb-sentiment@champion")
    out = model.predict(pd.DataFrame({"text": ["loved it", "dull"]}))
    assert len(out) == 2 and set(out["label"]) <= {"negative", "positive"}
    api = client.post("/v1/predict/text", json={"text": "loved it", "top_k": 1}).json()
    assert out["label"][0] == api["results"][0]["predictions"][0]["label"]


def test_download_bundle_finds_the_bundle_folder(registry, tmp_path) -> None:
    # MLflow keeps the logged folder's own name (artifacts/<name>), read from MLmodel
    ref = tracking.resolve_model("models:/cifar10-vit@champion")
    path = tracking.download_bundle(ref, tmp_path)
    assert (path / "meta.json").is_file() and (path / "weights.pt").is_file()
