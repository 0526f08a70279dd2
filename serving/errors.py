"""API errors: each is an ``HTTPException`` with a fixed status, rendered as ``{"detail": ...}``.

Core exceptions that reach a route are mapped too (undecodable image -> 400, too many pixels ->
413), and anything unexpected becomes a logged 500 with a generic JSON body.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.schemas import ErrorResponse
from vit_service.preprocess import ImageDecodeError, ImageTooLargeError

log = logging.getLogger(__name__)


_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_ABS_PATH = re.compile(r"(?<![\w:/.])/(?:[\w.@+-]+/)+[\w.@+-]*")


def strip_credentials(url: str) -> str:
    """``scheme://user:pass@host/...`` -> ``scheme://host/...``."""
    return _CREDENTIALS.sub(r"\g<scheme>", url)


def public_message(text: str, limit: int = 300) -> str:
    """An error message fit for an anonymous caller: no credentials in URLs, no file-system
    paths of the server, bounded length (the full text goes to the log)."""
    text = _ABS_PATH.sub("<path>", strip_credentials(text))
    return text if len(text) <= limit else text[: limit - 1] + "…"


class BadInputError(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(status_code=400, detail=detail)


class AuthError(HTTPException):
    def __init__(self, detail: str = "missing or invalid bearer token") -> None:
        super().__init__(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


class ForbiddenError(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(status_code=403, detail=detail)


class ModelNotFoundError(HTTPException):
    def __init__(self, name: str, available: Iterable[str]) -> None:
        names = ", ".join(sorted(available)) or "none"
        super().__init__(status_code=404, detail=f"unknown model {name!r}; served: {names}")


class PayloadTooLargeError(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(status_code=413, detail=detail)


class UnsupportedMediaTypeError(HTTPException):
    def __init__(self, got: str | None, accepted: Iterable[str]) -> None:
        super().__init__(
            status_code=415,
            detail=f"unsupported content type {got or '(none)'}; send {', '.join(accepted)}",
        )


class InvalidRequestError(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(status_code=422, detail=detail)


class ModelNotLoadedError(HTTPException):
    def __init__(self, name: str, reason: str | None = None) -> None:
        detail = f"no model loaded for {name!r}"
        if reason:
            detail += f": {reason}"
        super().__init__(status_code=503, detail=detail, headers={"Retry-After": "10"})


class OverloadedError(HTTPException):
    """The server sheds load rather than queueing without bound: try again shortly."""

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(status_code=503, detail=detail,
                         headers={"Retry-After": str(max(1, retry_after_s))})


def json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot carry made printable: non-finite floats as their
    ``repr`` (``inf``, ``nan``) and lone surrogates (valid in a JSON string escape, not in
    UTF-8) as ``\\udXXX`` escapes, in nested lists and dicts too."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def install_error_handlers(app: FastAPI) -> None:
    """Map core exceptions to JSON errors; never leak a traceback."""

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each error's input; one the JSON encoder cannot write
        # (a body's 1e999 parses to inf, a "\ud800" escape to a lone surrogate) turned the
        # 422 into a 500
        return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # a detail that quotes the request (a name, a value) is written safely as well
        exc.detail = json_safe(exc.detail)
        return await http_exception_handler(request, exc)

    @app.exception_handler(ImageDecodeError)
    async def _bad_image(request: Request, exc: ImageDecodeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(ImageTooLargeError)
    async def _too_many_pixels(request: Request, exc: ImageTooLargeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=413)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal server error"}, status_code=500)


# Shared ``responses=`` entries for the OpenAPI schema.
def error_responses(*codes: int) -> dict[int | str, dict]:
    text = {
        400: "undecodable or truncated image",
        401: "missing or wrong bearer token",
        403: "route disabled (no API key configured)",
        404: "unknown model",
        413: "body or image too large",
        415: "unsupported content type",
        422: "invalid JSON, empty text or bad parameter",
        429: "a queue is at its cap (the detail names it)",
        503: "model not loaded (yet)",
    }
    return {c: {"model": ErrorResponse, "description": text.get(c, "error")} for c in codes}
