"""Any registered model with a ``@champion`` alias is served beside the configured ones (up to
``discover_models``), with its card, in the page's model lists and for ``model=<name>``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

IMAGE = "/v1/predict/image"


def test_registered_champions_are_served_and_listed(
        registry, make_client: Callable[..., TestClient], image_bytes, tmp_path: Path) -> None:
    registry.register_copy("zz-pets", champion=True, tmp_path=tmp_path)
    registry.register_copy("zz-draft", champion=False, tmp_path=tmp_path)  # no champion: not served
    configured = {"cifar10-vit": "models:/cifar10-vit@champion"}
    c = make_client(configured, discover_models=50)
    names = {m["name"] for m in c.get("/v1/models").json()["models"]}
    assert {"cifar10-vit", "zz-pets", "reload-vit"} <= names and "zz-draft" not in names
    r = c.post(IMAGE, content=image_bytes(), headers={"content-type": "image/png"},
               params={"model": "zz-pets", "attention": "rollout"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"]["name"] == "zz-pets"
    assert body["results"][0]["predictions"][0]["label"].startswith("zz-pets-")
    assert body["results"][0]["attention"]["rollout"]
    card = c.get("/v1/models/zz-pets/card")
    assert card.status_code == 200 and card.json()["name"] == "zz-pets"
    assert c.post(IMAGE, content=image_bytes(), headers={"content-type": "image/png"},
                  params={"model": "zz-draft"}).status_code == 404


def test_discovery_is_capped_and_can_be_off(
        registry, make_client: Callable[..., TestClient], tmp_path: Path) -> None:
    registry.register_copy("zz-capped", champion=True, tmp_path=tmp_path)
    configured = {"local-vit": str(registry.local_bundle)}
    one = make_client(configured, discover_models=1)
    assert len(one.get("/v1/models").json()["models"]) == 2  # the configured one + 1
    off = make_client(configured, discover_models=0)
    assert [m["name"] for m in off.get("/v1/models").json()["models"]] == ["local-vit"]
