import numpy as np
import pytest

TEXT = "/v1/predict/text"
MAX_LEN = 16  # the test bundle's max_len (conftest.TEXT_MAX_LEN)


def test_single_text_with_token_aligned_rollout(client) -> None:
    r = client.post(TEXT, json={"text": "A moving, beautifully shot film."})
    assert r.status_code == 200, r.text
    body = r.json()
    m = body["model"]
    assert (m["name"], m["version"], m["alias"], m["task"]) == ("imdb-sentiment", "1",
                                                               "champion", "text")
    [res] = body["results"]
    assert [p["label"] for p in res["predictions"]] in (["negative", "positive"],
                                                        ["positive", "negative"])
    assert sum(p["probability"] for p in res["predictions"]) == pytest.approx(1.0, abs=1e-5)
    assert res["truncated"] is False
    tokens = res["tokens"]
    words = "".join(t[2:] if t.startswith("##") else " " + t for t in tokens).split()
    assert words[:2] == ["a", "moving"]  # WordPiece pieces, lower-cased
    assert "[CLS]" not in tokens and "[PAD]" not in tokens
    att = res["attention"]
    assert len(att["rollout"]) == len(tokens)
    assert sum(att["rollout"]) == pytest.approx(1.0, abs=1e-5)
    layers = np.array(att["layers"])
    assert layers.shape == (2, len(tokens))
    np.testing.assert_allclose(layers.sum(1), 1.0, atol=1e-5)
    assert att["heads"] is None


def test_list_of_texts_keeps_order_and_padding_is_excluded(client) -> None:
    texts = ["dull", "i loved every minute of this wonderful movie", "worst film of the year"]
    r = client.post(TEXT, json={"text": texts, "attention": "heads", "top_k": 1})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 3
    for text, res in zip(texts, results, strict=True):
        single = client.post(TEXT, json={"text": text, "attention": "heads", "top_k": 1}).json()
        [one] = single["results"]
        assert res["tokens"] == one["tokens"]  # not padded to the longest text of the request
        assert len(res["predictions"]) == 1
        assert res["predictions"][0]["index"] == one["predictions"][0]["index"]
        np.testing.assert_allclose(res["attention"]["rollout"], one["attention"]["rollout"],
                                   atol=1e-5)
        heads = np.array(res["attention"]["heads"])
        assert heads.shape == (2, 2, len(res["tokens"]))
        np.testing.assert_allclose(heads.sum(-1), 1.0, atol=1e-5)


def test_long_text_is_truncated(client) -> None:
    long = " ".join(["great"] * 100)
    res = client.post(TEXT, json={"text": long}).json()["results"][0]
    assert res["truncated"] is True
    assert len(res["tokens"]) == MAX_LEN - 1  # [CLS] takes one position
    assert len(res["attention"]["rollout"]) == MAX_LEN - 1


def test_attention_none(client) -> None:
    res = client.post(TEXT, json={"text": "boring", "attention": "none"}).json()["results"][0]
    assert res["attention"] is None and res["tokens"] == ["bor", "##ing"]


def test_text_errors(client) -> None:
    cases = [
        ({"text": ""}, 422),
        ({"text": "   "}, 422),
        ({"text": []}, 422),
        ({"text": ["fine", ""]}, 422),
        ({}, 422),
        ({"text": "ok", "top_k": 0}, 422),
        ({"text": "ok", "top_k": True}, 422),  # no coercion: true is no count, 1 no flag
        ({"text": "ok", "top_k": "2"}, 422),
        ({"text": "ok", "faithfulness": 1}, 422),
        ({"text": "ok", "faithfulness": "yes"}, 422),
        ({"text": "ok", "target": True}, 422),
        ({"text": "ok", "attention": "all"}, 422),
        ({"text": "ok", "unexpected": 1}, 422),
        ({"text": "ok", "model": "nope"}, 404),
        ({"text": "ok", "model": "cifar10-vit"}, 422),
        ({"text": "x" * 100_001}, 422),
        ({"text": ["x"] * 65}, 422),
    ]
    for payload, status in cases:
        r = client.post(TEXT, json=payload)
        assert r.status_code == status, (payload, r.text)
        assert "detail" in r.json()
    r = client.post(TEXT, content=b'{"text": "unterminated', headers={"content-type":
                                                                      "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"
    r = client.post(TEXT, content=b"just text", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = client.post(TEXT, content=b'{"text": "ok"}')  # no content type
    assert r.status_code == 415
    assert client.post(TEXT, json={"text": "still works"}).status_code == 200


def test_json_that_python_reads_but_cannot_write_back_is_a_422(client) -> None:
    """A lone surrogate escape is valid JSON but no text, and 1e999 parses to inf: each is
    refused with a 422 whose detail says where (its echoed input made printable), not a 500."""
    json_ct = {"content-type": "application/json"}
    cases = [
        (rb'{"text": "\ud800"}', ("body", "text"), "\\ud800"),
        (rb'{"text": ["fine", "a \udc00 b"]}', ("body", "text"), "lone surrogate"),
        (rb'{"text": "ok", "model": "\ud800"}', ("body", "model"), "\\ud800"),
        (rb'{"text": "ok", "attention": "\udfff"}', ("body", "attention"), "\\udfff"),
        (rb'{"text": "ok", "top_k": 1e999}', ("body", "top_k"), "inf"),
        (rb'{"text": "ok", "top_k": NaN}', ("body", "top_k"), "nan"),
        (rb'{"text": 1e999}', ("body", "text"), "inf"),
    ]
    for body, loc, shown in cases:
        r = client.post(TEXT, content=body, headers=json_ct)
        assert r.status_code == 422, (body, r.text)
        errors = r.json()["detail"]
        assert any(tuple(e["loc"][:2]) == loc for e in errors), (body, errors)
        assert shown in r.text, (body, r.text)
    assert client.post(TEXT, json={"text": "still works"}).status_code == 200


def test_f16_base64_encoding_of_text_maps_is_cut_to_the_real_tokens(client) -> None:
    import base64

    texts = ["dull", "i loved every minute of this wonderful movie"]
    ask = {"text": texts, "attention": "heads"}
    plain = client.post(TEXT, json=ask).json()["results"]
    enc = client.post(TEXT, json={**ask, "encoding": "f16-base64"}).json()["results"]
    for p, e in zip(plain, enc, strict=True):
        n = len(p["tokens"])
        for key, shape in (("rollout", (n,)), ("layers", (2, n)), ("heads", (2, 2, n))):
            a = e["attention"][key]
            got = np.frombuffer(base64.b64decode(a["data"]), "<f2").reshape(a["shape"])
            assert got.shape == shape, key
            np.testing.assert_allclose(got, np.array(p["attention"][key]), rtol=2e-3,
                                       atol=1e-4)
    r = client.post(TEXT, json={**ask, "encoding": "f32"})
    assert r.status_code == 422

