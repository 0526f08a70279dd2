import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlflow
import pytest

from vit_service import tracking

AUTH = {"Authorization": "Bearer secret-key-for-tests"}


def test_healthz_readyz(client) -> None:
    # one process: it leads (job scheduler, registry poll)
    assert client.get("/healthz").json() == {"status": "ok", "pid": os.getpid(), "leader": True}
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "loaded": {"cifar10-vit": "1", "imdb-sentiment": "1",
                                                      "local-vit": None}, "missing": [],
                        "pid": os.getpid()}


def test_list_models(client) -> None:
    models = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert set(models) == {"cifar10-vit", "imdb-sentiment", "local-vit"}
    vit = models["cifar10-vit"]
    assert vit["loaded"] and vit["version"] == "1" and vit["alias"] == "champion"
    assert vit["classes"][:2] == ["airplane", "automobile"] and len(vit["classes"]) == 10
    assert vit["input"]["image_size"] == 32 and vit["input"]["patch_grid"] == [4, 4]
    assert "image/png" in vit["input"]["content_types"]
    assert vit["run_url"] == (f"http://mlflow.example:5000/#/experiments/"
                              f"{mlflow.get_run(vit['run_id']).info.experiment_id}"
                              f"/runs/{vit['run_id']}")
    assert vit["architecture"]["arch"] == "vit" and vit["load_seconds"] >= 0
    text = models["imdb-sentiment"]
    assert text["input"]["type"] == "text" and text["input"]["max_len"] == 16
    assert text["classes"] == ["negative", "positive"]
    assert client.get("/v1/models/cifar10-vit").json()["version"] == "1"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["detail"]


def test_model_cards(client, make_client, registry) -> None:
    card = client.get("/v1/models/cifar10-vit/card").json()
    assert (card["name"], card["version"], card["alias"], card["task"]) == (
        "cifar10-vit", "1", "champion", "image")
    assert card["val_acc"] == 0.5  # what MLflow holds for the version's run
    assert card["parameters"] > 1000 and card["run_url"].endswith(card["run_id"])
    assert len(card["per_class"]) == 10 and card["per_class"][3]["label"] == "cat"
    assert card["per_class"][0]["recall"] == pytest.approx(5 / 6)
    assert card["confusion"][0][:2] == [5, 1] and card["training_s"] is not None
    text = client.get("/v1/models/imdb-sentiment/card").json()
    assert text["val_acc"] == 0.7 and text["per_class"] is None  # no report logged
    assert client.get("/v1/models/nope/card").status_code == 404
    local = make_client({"cifar10-vit": str(registry.local_bundle)})
    c = local.get("/v1/models/cifar10-vit/card").json()
    assert c["run_id"] is None and c["val_acc"] is None and c["version"] is None


def test_reload_auth(client, make_client) -> None:
    assert client.post("/v1/models/cifar10-vit/reload").status_code == 401
    r = client.post("/v1/models/cifar10-vit/reload", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.post("/v1/models/nope/reload", headers=AUTH).status_code == 404
    r = client.post("/v1/models/cifar10-vit/reload", headers=AUTH)
    assert r.status_code == 200
    assert r.json()["reloaded"] is False and r.json()["model"]["version"] == "1"
    r = client.post("/v1/models/cifar10-vit/reload", headers=AUTH, params={"force": "true"})
    assert r.json()["reloaded"] is True
    no_key = make_client({"cifar10-vit": "models:/cifar10-vit@champion"})  # api_key unset
    r = no_key.post("/v1/models/cifar10-vit/reload", headers=AUTH)
    assert r.status_code == 403 and "no API key" in r.json()["detail"]


@pytest.fixture
def reload_alias():
    """reload-vit@champion points at v1 during the test and afterwards."""
    client = mlflow.MlflowClient()
    client.set_registered_model_alias("reload-vit", tracking.CHAMPION, "1")
    yield lambda v: client.set_registered_model_alias("reload-vit", tracking.CHAMPION, v)
    client.set_registered_model_alias("reload-vit", tracking.CHAMPION, "1")


def _top(c, image: bytes) -> tuple[str, list[float]]:
    body = c.post("/v1/predict/image", params={"model": "reload-vit", "top_k": 10},
                  content=image, headers={"content-type": "image/png"}).json()
    return body["model"]["version"], [p["probability"] for p in body["results"][0]["predictions"]]


def test_alias_move_then_reload_endpoint_swaps_version(make_client, reload_alias,
                                                       image_bytes) -> None:
    c = make_client({"reload-vit": "models:/reload-vit@champion"}, api_key="secret-key-for-tests")
    img = image_bytes(seed=7)
    v, before = _top(c, img)
    assert v == "1"
    reload_alias("2")
    assert _top(c, img)[0] == "1"  # no poll configured: still the old version
    r = c.post("/v1/models/reload-vit/reload", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["reloaded"] is True and r.json()["previous_version"] == "1"
    assert r.json()["model"]["version"] == "2"
    v, after = _top(c, img)
    assert v == "2" and before != after
    assert c.get("/readyz").json()["loaded"] == {"reload-vit": "2"}


def test_old_version_keeps_serving_while_the_new_one_loads(make_client, reload_alias,
                                                          image_bytes, monkeypatch) -> None:
    c = make_client({"reload-vit": "models:/reload-vit@champion"}, api_key="secret-key-for-tests")
    store = c.app.state.store
    started, release = threading.Event(), threading.Event()
    real_load = store._load

    def slow_load(*args, **kwargs):
        started.set()
        release.wait(20)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(store, "_load", slow_load)
    reload_alias("2")
    img = image_bytes(seed=8)
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(c.post, "/v1/models/reload-vit/reload", headers=AUTH)
        assert started.wait(20)
        assert _top(c, img)[0] == "1"  # v2 is loading: v1 answers, no 503
        assert c.get("/readyz").status_code == 200
        release.set()
        assert pending.result().json()["model"]["version"] == "2"
    assert _top(c, img)[0] == "2"


def test_background_poll_picks_up_moved_alias(make_client, reload_alias, image_bytes) -> None:
    c = make_client({"reload-vit": "models:/reload-vit@champion"}, reload_interval_s=0.2)
    assert _top(c, image_bytes())[0] == "1"
    reload_alias("2")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if c.get("/v1/models/reload-vit").json()["version"] == "2":
            break
        time.sleep(0.1)
    assert _top(c, image_bytes())[0] == "2"
    metrics = c.get("/metrics").text
    assert 'vit_service_model_loads_total{model="reload-vit",outcome="ok"} 2.0' in metrics


def test_missing_model_is_503_until_it_appears(make_client, registry, tmp_path,
                                               image_bytes) -> None:
    target = tmp_path / "later"
    c = make_client({"cifar10-vit": "models:/no-such-model@champion", "later": str(target)},
                    api_key="secret-key-for-tests")
    r = c.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {"status": "not ready", "loaded": {}, "missing": ["cifar10-vit", "later"],
                        "pid": os.getpid()}
    r = c.post("/v1/predict/image", content=image_bytes(), headers={"content-type": "image/png"})
    assert r.status_code == 503 and "no model loaded for 'cifar10-vit'" in r.json()["detail"]
    r = c.post("/v1/predict/image", params={"model": "later"}, content=image_bytes(),
               headers={"content-type": "image/png"})
    assert r.status_code == 503
    entry = c.get("/v1/models/cifar10-vit").json()
    assert entry["loaded"] is False and "no-such-model" in entry["error"]
    assert c.post("/v1/models/later/reload", headers=AUTH).status_code == 503
    shutil.copytree(registry.local_bundle, target)  # the bundle appears
    r = c.post("/v1/models/later/reload", headers=AUTH)
    assert r.status_code == 200 and r.json()["reloaded"] is True
    r = c.post("/v1/predict/image", params={"model": "later"}, content=image_bytes(),
               headers={"content-type": "image/png"})
    assert r.status_code == 200
    assert c.get("/readyz").status_code == 503  # cifar10-vit is still missing
    lenient = make_client({"cifar10-vit": "models:/no-such-model@champion",
                           "later": str(target)}, ready_requires_all=False)
    assert lenient.get("/readyz").status_code == 200


def test_metrics(client, image_bytes) -> None:
    client.post("/v1/predict/image", content=image_bytes(), headers={"content-type": "image/png"})
    client.post("/v1/predict/image", content=b"\0" * (11 * 1024 * 1024),
                headers={"content-type": "image/png"})
    client.get("/v1/models/whatever")
    client.get("/no/such/path")
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in [
        'vit_service_http_requests_total{method="POST",route="/v1/predict/image",status="200"}',
        'vit_service_http_requests_total{method="POST",route="/v1/predict/image",status="413"}',
        'vit_service_http_requests_total{method="GET",route="/v1/models/{name}",status="404"}',
        'vit_service_http_requests_total{method="GET",route="unmatched",status="404"}',
        'vit_service_http_request_duration_seconds_bucket{le="0.1",method="POST",'
        'route="/v1/predict/image",status="200"}',
        'vit_service_batch_size_bucket{le="1.0",model="cifar10-vit"}',
        'vit_service_model_load_seconds{model="cifar10-vit"}',
        'vit_service_model_loaded{model="imdb-sentiment"} 1.0',
    ]:
        assert line in text, line
    # where the time goes: one observation per stage for the one image predicted here
    for stage in ("decode", "queue", "preprocess", "maps", "results", "serialise"):
        assert (f'vit_service_stage_seconds_count{{model="cifar10-vit",stage="{stage}"}}'
                in text), stage
    client.post("/v1/predict/image", content=image_bytes(), params={"attention": "relevance"},
                headers={"content-type": "image/png"})
    text = client.get("/metrics").text
    assert 'vit_service_stage_seconds_count{model="cifar10-vit",stage="relevance"} 1.0' in text


def test_openapi_documents_every_route(client) -> None:
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    assert set(paths) >= {"/healthz", "/readyz", "/metrics", "/v1/predict/image",
                          "/v1/predict/text", "/v1/models", "/v1/models/{name}",
                          "/v1/models/{name}/reload"}  # other resources (jobs...) may add more
    img = paths["/v1/predict/image"]["post"]
    assert {"multipart/form-data", "image/png", "image/jpeg"} <= set(img["requestBody"]["content"])
    assert img["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ImagePredictResponse")
    assert {"400", "404", "413", "415", "422", "503"} <= set(img["responses"])
    text = paths["/v1/predict/text"]["post"]
    assert text["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "TextPredictRequest")
    reload = paths["/v1/models/{name}/reload"]["post"]
    assert reload["security"] and {"401", "403"} <= set(reload["responses"])
    for name in ("ModelInfo", "Prediction", "ImageAttention", "TextResult", "ModelsResponse",
                 "ReadyResponse", "ErrorResponse"):
        assert name in spec["components"]["schemas"]



@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_served_precision_is_the_setting_and_is_reported(make_client, registry, tmp_path,
                                                            image_bytes, precision) -> None:
    """``inference_precision`` decides what the forward runs in: the answers are the model's
    own in that precision (bf16: autocast, explicit attention), every response and the model
    entry and card say which, with the validation accuracy measured in it."""
    import torch

    from vit_service.bundle import load_bundle, save_bundle
    from vit_service.precision import inference_precision
    from vit_service.preprocess import decode_image, images_to_tensor

    src = load_bundle(registry.local_bundle)
    src.meta.extra.update(val_acc=0.61, val_acc_bf16=0.62)
    bundle = save_bundle(tmp_path / "b", src.model, src.meta)
    c = make_client({"cifar10-vit": str(bundle)}, inference_precision=precision)
    img = image_bytes(seed=3)
    res = c.post("/v1/predict/image", content=img, headers={"content-type": "image/png"},
                 params={"top_k": 10, "attention": "rollout"}).json()
    assert res["model"]["precision"] == precision
    model = load_bundle(bundle).model.eval()
    with torch.inference_mode(), inference_precision(model, precision):
        want = model(images_to_tensor([decode_image(img)], src.meta)).float().softmax(-1)[0]
    got = {p["index"]: p["probability"] for p in res["results"][0]["predictions"]}
    for k, p in got.items():
        assert p == pytest.approx(float(want[k]), abs=1e-5)
    entry = c.get("/v1/models/cifar10-vit").json()
    card = c.get("/v1/models/cifar10-vit/card").json()
    served = 0.62 if precision == "bf16" else 0.61
    assert entry["precision"] == card["precision"] == precision
    assert entry["served_val_acc"] == card["served_val_acc"] == served
