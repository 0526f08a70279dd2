"""attention=relevance, target= and faithfulness=true through the API (images and texts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

IMAGE = "/v1/predict/image"
TEXT = "/v1/predict/text"


def _post_png(client, data: bytes, **params):
    return client.post(IMAGE, content=data, headers={"content-type": "image/png"}, params=params)


def _probs(result: dict) -> dict[int, float]:
    return {p["index"]: p["probability"] for p in result["predictions"]}


def test_image_relevance_with_heads_and_faithfulness(client, image_bytes) -> None:
    data = image_bytes(seed=5)
    r = _post_png(client, data, attention=["heads", "relevance"], faithfulness="true",
                  top_k=10)
    assert r.status_code == 200, r.text
    [res] = r.json()["results"]
    att = res["attention"]
    rel = np.array(att["relevance"])
    assert rel.shape == (4, 4) and rel.min() >= 0 and rel.sum() == pytest.approx(1.0, abs=1e-5)
    assert np.array(att["heads"]).shape == (2, 2, 4, 4)
    top = res["predictions"][0]
    assert att["target"] == {"label": top["label"], "index": top["index"]}
    f = res["faithfulness"]
    assert f["target"] == att["target"] and f["removal"] == "mean_colour"
    assert set(f["maps"]) == {"rollout", "relevance", "random"}
    assert f["fractions"][0] == 0 and f["fractions"][-1] == 1 and len(f["fractions"]) == 11
    for curve in f["maps"].values():
        assert len(curve["deletion"]) == len(curve["insertion"]) == 11
        # both curves end at the unperturbed probability, and share the blank input
        assert curve["deletion"][0] == pytest.approx(top["probability"], abs=1e-5)
        assert curve["insertion"][-1] == pytest.approx(top["probability"], abs=1e-5)
        assert curve["deletion"][-1] == pytest.approx(curve["insertion"][0])
        assert 0 <= curve["deletion_auc"] <= 1 and 0 <= curve["insertion_auc"] <= 1
    rand = f["maps"]["random"]["deletion_auc"]
    assert f["deletion_ratio"]["relevance"] == pytest.approx(
        f["maps"]["relevance"]["deletion_auc"] / rand)
    assert f["most_faithful"] in {"rollout", "relevance", "random"}
    # the same prediction as the plain path
    plain = _post_png(client, data, attention="none", top_k=10).json()["results"][0]
    for k, v in _probs(plain).items():
        assert _probs(res)[k] == pytest.approx(v, abs=1e-5)


def test_image_target_by_label_and_index(client, image_bytes) -> None:
    data = image_bytes(seed=6)
    by_label = _post_png(client, data, attention="relevance", target="ship").json()["results"][0]
    by_index = _post_png(client, data, attention="relevance", target="8").json()["results"][0]
    assert by_label["attention"]["target"] == {"label": "ship", "index": 8}
    a, b = (np.array(r["attention"]["relevance"]) for r in (by_label, by_index))
    np.testing.assert_allclose(a, b, atol=1e-6)
    other = _post_png(client, data, attention="relevance", target="cat").json()["results"][0]
    assert not np.allclose(np.array(other["attention"]["relevance"]), a, atol=1e-4)
    f = _post_png(client, data, faithfulness="true", target="cat").json()["results"][0]
    assert f["faithfulness"]["target"]["label"] == "cat" and f["attention"]["relevance"] is None
    assert set(f["faithfulness"]["maps"]) == {"rollout", "random"}


def test_overlay_draws_relevance_when_asked(client, image_bytes) -> None:
    data = image_bytes(seed=7)
    rel = _post_png(client, data, attention="relevance", overlay="true").json()["results"][0]
    roll = _post_png(client, data, attention="rollout", overlay="true").json()["results"][0]
    assert rel["overlay_png"] and roll["overlay_png"] and rel["overlay_png"] != roll["overlay_png"]


@pytest.mark.parametrize("params, needle", [
    ({"attention": ["none", "relevance"]}, "cannot be combined"),
    ({"attention": "none", "faithfulness": "true"}, "needs attention maps"),
    ({"attention": "rollout", "target": "ship"}, "target only applies"),
    ({"attention": "relevance", "target": "giraffe"}, "unknown target"),
    ({"attention": "relevance", "target": "10"}, "unknown target"),
    ({"attention": "relevance", "target": "\u00b2"}, "unknown target"),  # isdigit, not int
    ({"attention": "relevance", "target": "9" * 5000}, "at most 200 characters"),
    ({"attention": "sideways"}, "Input should be"),
])
def test_bad_explanation_options_are_422(client, image_bytes, params, needle) -> None:
    r = _post_png(client, image_bytes(), **params)
    assert r.status_code == 422, r.text
    assert needle in str(r.json()["detail"])


def test_concurrent_plain_request_is_unaffected_by_relevance(client, image_bytes) -> None:
    data = image_bytes(seed=9)
    ref = _probs(_post_png(client, data, attention="none", top_k=10).json()["results"][0])
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(_post_png, client, data, attention="relevance" if i % 2 else "none",
                            faithfulness="true" if i % 4 == 1 else "false", top_k=10)
                for i in range(16)]
        results = [f.result() for f in futs]
    assert all(r.status_code == 200 for r in results)
    for i, r in enumerate(results):
        got = _probs(r.json()["results"][0])
        assert got == pytest.approx(ref, abs=1e-5), i
    again = _probs(_post_png(client, data, attention="none", top_k=10).json()["results"][0])
    assert again == ref  # the model did not change


def test_text_relevance_and_faithfulness(client) -> None:
    body = {"text": ["a moving beautifully shot film", "dull and terrible"],
            "attention": ["relevance"], "faithfulness": True, "target": "1"}
    r = client.post(TEXT, json=body)
    assert r.status_code == 200, r.text
    for res in r.json()["results"]:
        att = res["attention"]
        n = len(res["tokens"])
        assert len(att["relevance"]) == n == len(att["rollout"])
        assert sum(att["relevance"]) == pytest.approx(1.0, abs=1e-5)
        assert att["target"]["index"] == 1
        f = res["faithfulness"]
        assert f["removal"] == "attention_mask" and f["target"]["index"] == 1
        assert f["fractions"][-1] == 1.0
        p1 = _probs({"predictions": res["predictions"]})[1]
        assert f["maps"]["relevance"]["deletion"][0] == pytest.approx(p1, abs=1e-5)
    bad = client.post(TEXT, json={"text": "fine", "attention": "none", "faithfulness": True})
    assert bad.status_code == 422 and "needs attention maps" in bad.text
    bad = client.post(TEXT, json={"text": "fine", "attention": "relevance", "target": "maybe"})
    assert bad.status_code == 422 and "unknown target" in bad.text
    bad = client.post(TEXT, json={"text": "fine", "attention": "relevance", "target": "1" * 300})
    assert bad.status_code == 422
    many = client.post(TEXT, json={"text": ["good film"] * 17, "faithfulness": True})
    assert many.status_code == 422 and "at most 16 texts" in many.text
    assert client.post(TEXT, json={"text": ["good film"] * 17}).status_code == 200


class _Broken(RuntimeError):
    pass


def _break_relevance(model) -> None:
    def attention_graph(*args, **kwargs):
        raise _Broken("no graph here")

    model.attention_graph = attention_graph  # an instance attribute: this model only


def test_a_model_that_cannot_give_relevance_is_probed_at_load(make_client, registry) -> None:
    from serving.model_store import probe_relevance

    models = {"local-vit": str(registry.local_bundle)}
    fp32, bf16 = (make_client(models, inference_precision=p).app.state.store.get("local-vit")
                  for p in ("fp32", "bf16"))
    assert fp32.precision == "fp32" and bf16.precision == "bf16"
    assert probe_relevance(fp32) is None and probe_relevance(bf16) is None
    _break_relevance(bf16.bundle.model)
    reason = probe_relevance(bf16)
    assert reason is not None and "bf16" in reason and "_Broken" in reason


def test_a_failing_relevance_pass_is_a_422_with_the_reason_never_a_500(
        make_client, registry, image_bytes) -> None:
    client = make_client({"local-vit": str(registry.local_bundle)})
    served = client.app.state.store.get("local-vit")
    card = client.get("/v1/models").json()["models"][0]
    assert card["relevance"] is True and card["relevance_unavailable"] is None
    _break_relevance(served.bundle.model)
    data = image_bytes(seed=11)
    params = {"model": "local-vit", "attention": "relevance", "faithfulness": "true"}
    r = _post_png(client, data, **params)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "cannot give relevance" in detail and "_Broken" in detail and "no graph" not in detail
    card = client.get("/v1/models").json()["models"][0]
    assert card["relevance"] is False and "_Broken" in card["relevance_unavailable"]
    assert _post_png(client, data, **params).status_code == 422  # refused up front now
    ok = _post_png(client, data, model="local-vit", attention="rollout", faithfulness="true")
    assert ok.status_code == 200, ok.text  # the prediction and rollout keep being served
    assert set(ok.json()["results"][0]["faithfulness"]["maps"]) == {"rollout", "random"}
