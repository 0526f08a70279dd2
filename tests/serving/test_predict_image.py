import base64
import io

import numpy as np
import pytest
from PIL import Image

IMAGE = "/v1/predict/image"


def _post_png(client, data: bytes, **params):
    return client.post(IMAGE, content=data, headers={"content-type": "image/png"}, params=params)


def test_raw_png_prediction_with_rollout(client, image_bytes) -> None:
    r = _post_png(client, image_bytes(), top_k=3)
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["model"]
    assert (m["name"], m["version"], m["alias"], m["task"]) == ("cifar10-vit", "1", "champion",
                                                               "image")
    assert m["run_id"] and m["source"] == "models:/cifar10-vit@champion"
    assert m["run_url"].startswith("http://mlflow.example:5000/#/experiments/")
    assert m["run_url"].endswith(f"/runs/{m['run_id']}")
    [res] = body["results"]
    assert (res["width"], res["height"]) == (40, 30)
    preds = res["predictions"]
    assert len(preds) == 3
    probs = [p["probability"] for p in preds]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    for p in preds:
        assert set(p) == {"label", "index", "probability"}
    att = res["attention"]
    assert att["grid"] == [4, 4]
    rollout = np.array(att["rollout"])
    assert rollout.shape == (4, 4) and rollout.sum() == pytest.approx(1.0, abs=1e-5)
    layers = np.array(att["layers"])
    assert layers.shape == (2, 4, 4)
    np.testing.assert_allclose(layers.sum((1, 2)), 1.0, atol=1e-5)
    assert att["heads"] is None and res["overlay_png"] is None


def test_attention_levels(client, image_bytes) -> None:
    data = image_bytes(seed=3)
    heads = _post_png(client, data, attention="heads").json()["results"][0]
    h = np.array(heads["attention"]["heads"])
    assert h.shape == (2, 2, 4, 4)  # (layers, heads, grid)
    np.testing.assert_allclose(h.sum((2, 3)), 1.0, atol=1e-5)
    layers = _post_png(client, data, attention="layers").json()["results"][0]
    assert layers["attention"]["heads"] is None
    assert layers["attention"]["rollout"] == heads["attention"]["rollout"]
    none = _post_png(client, data, attention="none").json()["results"][0]
    assert none["attention"] is None
    # the fused fast path gives the same prediction as the explicit-attention path
    a = [p["probability"] for p in none["predictions"]]
    b = [p["probability"] for p in heads["predictions"]]
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert [p["index"] for p in none["predictions"]] == [p["index"] for p in heads["predictions"]]


def _decode_f16(a: dict) -> np.ndarray:
    assert set(a) == {"dtype", "shape", "data"} and a["dtype"] == "float16"
    return np.frombuffer(base64.b64decode(a["data"]), "<f2").reshape(a["shape"])


def test_f16_base64_encoding_holds_the_same_maps(client, image_bytes) -> None:
    data = image_bytes(seed=4)
    ask = {"attention": ["heads", "relevance"]}
    plain = _post_png(client, data, **ask).json()["results"][0]["attention"]
    enc = _post_png(client, data, **ask, encoding="f16-base64").json()["results"][0]
    att = enc["attention"]
    assert att["grid"] == plain["grid"] and att["target"] == plain["target"]
    for key, shape in (("rollout", (4, 4)), ("layers", (2, 4, 4)), ("heads", (2, 2, 4, 4)),
                       ("relevance", (4, 4))):
        got = _decode_f16(att[key])
        assert got.shape == shape, key
        np.testing.assert_allclose(got, np.array(plain[key]), rtol=2e-3, atol=1e-4)
    r = _post_png(client, data, encoding="f32")
    assert r.status_code == 422


def test_default_top_k_and_cap_at_number_of_classes(client, image_bytes) -> None:
    assert len(_post_png(client, image_bytes()).json()["results"][0]["predictions"]) == 5
    preds = _post_png(client, image_bytes(), top_k=50).json()["results"][0]["predictions"]
    assert sorted(p["index"] for p in preds) == list(range(10))
    assert sum(p["probability"] for p in preds) == pytest.approx(1.0, abs=1e-5)


def test_several_files_in_one_multipart_request_keep_their_order(client, image_bytes) -> None:
    files = [
        ("file", ("a.png", image_bytes((40, 30), seed=1), "image/png")),
        ("file", ("b.jpg", image_bytes((64, 48), "JPEG", seed=2), "image/jpeg")),
        ("file", ("c.png", image_bytes((17, 90), mode="L", seed=3), "image/png")),
        ("file", ("d.png", image_bytes((32, 32), mode="RGBA", seed=4), "application/x-foo")),
    ]
    r = client.post(IMAGE, files=files, params={"top_k": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["filename"] for x in results] == ["a.png", "b.jpg", "c.png", "d.png"]
    assert [(x["width"], x["height"]) for x in results] == [(40, 30), (64, 48), (17, 90), (32, 32)]
    for (_, (_, data, _)), res in zip(files, results, strict=True):
        single = _post_png(client, data, top_k=2).json()["results"][0]
        np.testing.assert_allclose(
            [p["probability"] for p in res["predictions"]],
            [p["probability"] for p in single["predictions"]], atol=1e-5)
        np.testing.assert_allclose(res["attention"]["rollout"], single["attention"]["rollout"],
                                   atol=1e-5)


def test_raw_jpeg_body_and_any_mode(client, image_bytes) -> None:
    r = client.post(IMAGE, content=image_bytes((300, 200), "JPEG"),
                    headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    r = _post_png(client, image_bytes((8, 8), mode="RGBA"))
    assert r.status_code == 200, r.text


def test_overlay_is_a_base64_png(client, image_bytes) -> None:
    r = _post_png(client, image_bytes((32, 32)), overlay="true")
    png = base64.b64decode(r.json()["results"][0]["overlay_png"])
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size == (224, 224)
    r = _post_png(client, image_bytes(), overlay="true", attention="none")
    assert r.status_code == 422


def test_local_bundle_model(client, image_bytes) -> None:
    r = _post_png(client, image_bytes(), model="local-vit")
    assert r.status_code == 200, r.text
    m = r.json()["model"]
    assert m["version"] is None and m["run_id"] is None and m["source"].endswith("local")


# --- errors: clear JSON, never a 500, and the server keeps working ---------------------------


def test_bad_inputs(client, image_bytes, png_header) -> None:
    good = image_bytes()
    jpeg = image_bytes((64, 64), "JPEG")
    cases = [
        # (content, content-type, params, status, text in detail)
        (b"\x89PNG\r\n\x1a\nthis is not a png", "image/png", {}, 400, "cannot decode"),
        (good[: len(good) // 2], "image/png", {}, 400, "cannot decode"),  # truncated PNG
        (jpeg[: len(jpeg) * 2 // 3], "image/jpeg", {}, 400, "cannot decode"),  # truncated JPEG
        (b"", "image/png", {}, 400, "empty"),
        (b"hello", "text/plain", {}, 415, "unsupported content type"),
        (good, "application/octet-stream", {}, 415, "unsupported content type"),
        (png_header(100_000, 100_000), "image/png", {}, 413, "pixels"),
        (png_header(5000, 4000), "image/png", {}, 413, "limit"),  # 20 MP > 12 MP default
        (good, "image/png", {"model": "nope"}, 404, "unknown model"),
        (good, "image/png", {"model": "imdb-sentiment"}, 422, "text model"),
        (good, "image/png", {"top_k": 0}, 422, None),
        (good, "image/png", {"top_k": "many"}, 422, None),
        (good, "image/png", {"attention": "everything"}, 422, None),
    ]
    for content, ctype, params, status, text in cases:
        r = client.post(IMAGE, content=content, headers={"content-type": ctype}, params=params)
        assert r.status_code == status, (ctype, params, r.status_code, r.text)
        detail = r.json()["detail"]
        if text is not None:
            assert text in str(detail), detail
    r = client.post(IMAGE, content=good)  # no content type at all
    assert r.status_code == 415
    r = client.post(IMAGE, files=[("other", ("a.png", good, "image/png"))])
    assert r.status_code == 422 and "'file'" in r.json()["detail"]
    r = client.post(IMAGE, data={"file": "not a file"}, files=[("x", ("a", b"1", "a/b"))])
    assert r.status_code == 422
    bad_multi = [("file", ("ok.png", good, "image/png")), ("file", ("bad.png", b"xx", "image/png"))]
    r = client.post(IMAGE, files=bad_multi)
    assert r.status_code == 400 and "image 1 (bad.png)" in r.json()["detail"]
    assert _post_png(client, good).status_code == 200  # still serving


def test_body_limit_declared_and_streamed(client, image_bytes) -> None:
    big = b"\0" * (11 * 1024 * 1024)
    r = client.post(IMAGE, content=big, headers={"content-type": "image/png"})
    assert r.status_code == 413 and "limit of 10485760 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the server must count
        for _ in range(11):
            yield b"\0" * (1024 * 1024)

    r = client.post(IMAGE, content=chunks(), headers={"content-type": "image/png"})
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    files = [("file", ("big.png", big, "image/png"))]
    assert client.post(IMAGE, files=files).status_code == 413
    r = client.post("/v1/predict/text", content=b'{"text": "' + b"a" * len(big) + b'"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert _post_png(client, image_bytes()).status_code == 200
