"""The prediction bodies are written by orjson, not by pydantic (serving/routers/predict.py):
every kind of answer must still be what the documented schema says, and the attention arrays
must be written as float32 values (short), not as the doubles they would become as lists."""

from __future__ import annotations

import re

import numpy as np
import pytest

from serving.schemas import ImagePredictResponse, TextPredictResponse

IMAGE = "/v1/predict/image"
TEXT = "/v1/predict/text"
NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")

IMAGE_ASKS = [
    {"attention": "none"},
    {"attention": "rollout"},
    {"attention": "heads", "overlay": "true"},
    {"attention": ["heads", "relevance"], "faithfulness": "true", "target": "cat"},
    {"attention": ["heads", "relevance"], "encoding": "f16-base64"},
]
TEXT_ASKS = [
    {"attention": "none"},
    {"attention": "rollout"},
    {"attention": ["heads", "relevance"], "faithfulness": True},
    {"attention": "heads", "encoding": "f16-base64"},
]


@pytest.mark.parametrize("ask", IMAGE_ASKS, ids=lambda a: str(a["attention"]))
def test_every_image_answer_matches_its_schema(client, image_bytes, ask) -> None:
    r = client.post(IMAGE, content=image_bytes(seed=7),
                    headers={"content-type": "image/png"}, params=ask)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    body = ImagePredictResponse.model_validate_json(r.content)  # raises if off-schema
    assert body.model.loaded_at.tzinfo is not None
    assert r.json()["model"]["loaded_at"].endswith("Z")  # as pydantic writes datetimes
    assert len(body.results) == 1


@pytest.mark.parametrize("ask", TEXT_ASKS, ids=lambda a: str(a["attention"]))
def test_every_text_answer_matches_its_schema(client, ask) -> None:
    r = client.post(TEXT, json={"text": ["a fine film", "dull and long, far too long"], **ask})
    assert r.status_code == 200, r.text
    body = TextPredictResponse.model_validate_json(r.content)
    assert len(body.results) == 2
    assert all((x.attention is None) == (ask["attention"] == "none") for x in body.results)


def _numbers(fragment: bytes) -> list[bytes]:
    return NUMBER.findall(fragment)


def test_attention_arrays_are_written_as_float32(client, image_bytes) -> None:
    r = client.post(IMAGE, content=image_bytes(seed=8), headers={"content-type": "image/png"},
                    params={"attention": "heads"})
    raw = r.content
    att = r.json()["results"][0]["attention"]
    start = raw.index(b'"rollout"')
    nums = _numbers(raw[start:raw.index(b'"relevance"', start)])
    assert len(nums) == 16 + 2 * 16 + 2 * 2 * 16  # rollout (4, 4), layers, heads
    for s in nums:  # float32 needs at most 9 significant digits; a double's repr ~17
        digits = s.split(b"e")[0].split(b"E")[0].lstrip(b"-").replace(b".", b"").lstrip(b"0")
        assert len(digits) <= 9, s
    # the values are the maps' own: parsed back to float32 they still sum to one per map
    np.testing.assert_allclose(np.array(att["heads"], np.float32).sum((2, 3)), 1.0, atol=1e-5)
