"""Errors are JSON the client can read, whatever the request quoted back."""

import json

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from serving.errors import install_error_handlers, json_safe


def test_json_safe_makes_non_finite_numbers_and_lone_surrogates_printable() -> None:
    value = {"a\ud800": [float("inf"), float("-inf"), 1.5, ("x\udfffy", None, 3)],
             "n": float("nan"), "ok": "café"}
    got = json_safe(value)
    assert got == {"a\\ud800": ["inf", "-inf", 1.5, ["x\\udfffy", None, 3]], "n": "nan",
                   "ok": "café"}
    json.dumps(got, allow_nan=False).encode("utf-8")  # writable as strict JSON, in UTF-8


def test_an_http_error_quoting_a_lone_surrogate_keeps_its_status_and_headers() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise HTTPException(409, detail="name 'a\ud800' is taken", headers={"Retry-After": "3"})

    @app.get("/gone")
    def gone() -> None:
        raise HTTPException(304)

    with TestClient(app) as c:
        r = c.get("/boom")
        assert r.status_code == 409 and r.headers["retry-after"] == "3"
        assert r.json() == {"detail": "name 'a\\ud800' is taken"}
        r = c.get("/gone")
        assert r.status_code == 304 and r.content == b""
