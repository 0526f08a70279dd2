"""``/v1/datasets``: upload real archives and tables, list, show, delete; bad uploads get a
4xx that names what is wrong and leave nothing on disk."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

KEY = "secret-key-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


SHAPES = _zip({f"{c}/{i}.png": _png(k * 10 + i) for k, c in enumerate(("round", "square"))
               for i in range(5)})


@pytest.fixture
def api(make_client: Callable[..., TestClient], tmp_path: Path) -> TestClient:
    return make_client({}, home=tmp_path / "home", api_key=KEY, max_dataset_bytes=200_000)


def _files(home: Path) -> list[Path]:
    root = home / "datasets"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_upload_list_show_delete(api: TestClient, tmp_path: Path) -> None:
    r = api.post("/v1/datasets?name=shapes.zip", content=SHAPES,
                 headers={**AUTH, "Content-Type": "application/zip"})
    assert r.status_code == 201, r.text
    d = r.json()
    assert d["kind"] == "image" and d["classes"] == ["round", "square"]
    assert d["counts"] == {"train": {"round": 5, "square": 5}} and d["filename"] == "shapes.zip"
    again = api.post("/v1/datasets?name=copy.zip", content=SHAPES,
                     headers={**AUTH, "Content-Type": "application/zip"})
    assert again.status_code == 200 and again.json()["id"] == d["id"]
    assert [x["id"] for x in api.get("/v1/datasets", headers=AUTH).json()["datasets"]] == [d["id"]]
    assert api.get(f"/v1/datasets/{d['id']}", headers=AUTH).json()["sha256"] == d["sha256"]
    assert api.delete(f"/v1/datasets/{d['id']}", headers=AUTH).status_code == 204
    assert api.get(f"/v1/datasets/{d['id']}", headers=AUTH).status_code == 404
    assert _files(tmp_path / "home") == []


def test_a_text_table(api: TestClient) -> None:
    body = "text,label\n" + "".join(f"review {i},{'pos' if i % 2 else 'neg'}\n"
                                    for i in range(10))
    r = api.post("/v1/datasets?name=reviews.csv", content=body.encode(),
                 headers={**AUTH, "Content-Type": "text/csv"})
    assert r.status_code == 201, r.text
    assert r.json()["kind"] == "text" and r.json()["counts"]["train"] == {"neg": 5, "pos": 5}


@pytest.mark.parametrize(("body", "ctype", "name", "code", "message"), [
    (_zip({"round/0.png": b"garbage", **{f"square/{i}.png": _png(i) for i in range(5)}}),
     "application/zip", "x.zip", 422, "round/0.png"),
    (_zip({"../up.png": _png(0)}), "application/zip", "x.zip", 422, "'..'"),
    (_zip({"a/big.png": b"\0" * 3_000_000}), "application/zip", "x.zip", 422, "zip bomb"),
    (b"review,label\nx,1\n", "text/csv", "r.csv", 422, "lacks the column"),
    (b"text,label\n" + b"same,1\n" * 6, "text/csv", "r.csv", 422, "1 class"),
    (b"x" * 300_000, "application/zip", "x.zip", 413, "exceeds the limit"),
    (SHAPES, "image/png", "x.zip", 415, "unsupported"),
])
def test_bad_uploads_get_a_clear_4xx_and_leave_nothing(
        api: TestClient, tmp_path: Path, body: bytes, ctype: str, name: str, code: int,
        message: str) -> None:
    r = api.post(f"/v1/datasets?name={name}", content=body,
                 headers={**AUTH, "Content-Type": ctype})
    assert r.status_code == code, r.text
    assert message.lower() in r.json()["detail"].lower()
    assert _files(tmp_path / "home") == []


def test_every_route_needs_the_key(api: TestClient) -> None:
    assert api.get("/v1/datasets").status_code == 401
    r = api.post("/v1/datasets?name=s.zip", content=SHAPES,
                 headers={"Content-Type": "application/zip"})
    assert r.status_code == 401
    assert api.delete("/v1/datasets/0123456789abcdef").status_code == 401
    assert api.get("/v1/datasets/0123456789abcdef", headers=AUTH).status_code == 404
