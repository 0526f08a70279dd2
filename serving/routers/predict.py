"""``POST /v1/predict/image`` and ``POST /v1/predict/text``."""

from __future__ import annotations

import logging
import time
from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from starlette.datastructures import UploadFile

from serving.deps import JsonBodyDep, ServiceDep, SettingsDep, StoreDep, loaded_model
from serving.errors import (
    BadInputError,
    InvalidRequestError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    error_responses,
)
from serving.explanations import build_spec, check_explain_size, check_relevance
from serving.inference import (
    ImageInput,
    ImageJob,
    InferenceService,
    JobOutput,
    TextJob,
    lane_of,
)
from serving.model_store import IMAGE_CONTENT_TYPES
from serving.schemas import (
    AttentionEncoding,
    AttentionKind,
    ImagePredictResponse,
    ModelInfo,
    TextPredictRequest,
    TextPredictResponse,
)
from vit_service.preprocess import (
    ImageDecodeError,
    ImageTooLargeError,
    decode_image,
    image_header,
)

log = logging.getLogger(__name__)

router = APIRouter(prefix="/predict", tags=["predict"])

MULTIPART = "multipart/form-data"

_IMAGE_BODY = {
    "requestBody": {
        "required": True,
        "description": "one or more images as multipart `file` fields (one result each, in "
        "order), or a single raw image body",
        "content": {
            MULTIPART: {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                        }
                    },
                    "required": ["file"],
                }
            },
            **{ct: {"schema": {"type": "string", "format": "binary"}}
               for ct in IMAGE_CONTENT_TYPES},
        },
    }
}


async def _read_images(request: Request, max_items: int) -> list[tuple[bytes, str | None]]:
    """Raw bytes (and file names) from a multipart or raw-image body."""
    ctype = request.headers.get("content-type", "")
    main = ctype.split(";", 1)[0].strip().lower()
    if main == MULTIPART:
        async with request.form(max_files=max_items, max_fields=max_items) as form:
            fields = form.getlist("file")
            if not fields:
                raise InvalidRequestError("multipart body has no 'file' field")
            out = []
            for i, f in enumerate(fields):
                if not isinstance(f, UploadFile):
                    raise InvalidRequestError(f"'file' field {i} is not a file upload")
                out.append((await f.read(), f.filename))
            return out
    if main in IMAGE_CONTENT_TYPES:
        return [(await request.body(), None)]
    raise UnsupportedMediaTypeError(ctype, [MULTIPART, *IMAGE_CONTENT_TYPES])


# numpy: the attention arrays come as float32 arrays and are written in float32's shortest
# form (~10 characters a value instead of ~19 for the same number as a double); UTC_Z:
# datetimes as pydantic writes them ("...Z").
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_UTC_Z


def _fields(o: object) -> dict:
    """orjson's fallback for the schema objects: their fields, in the schema's order."""
    if isinstance(o, BaseModel):
        return o.__dict__
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _body(out: JobOutput) -> bytes:
    """The answer as :class:`ImagePredictResponse` / :class:`TextPredictResponse`, built
    without validation from what the inference thread computed and written by orjson (the
    route's ``response_model`` documents it; the tests validate every kind of answer against
    it): pydantic's validate + dump of the same answer costs the event loop far more
    (docs/serving.md, "Now: answers encoded by orjson")."""
    info = out.model.info()
    kind = ImagePredictResponse if info["task"] == "image" else TextPredictResponse
    answer = kind.model_construct(model=ModelInfo.model_construct(**info), results=out.results)
    return orjson.dumps(answer, default=_fields, option=_JSON_OPTIONS)


def _respond(service: InferenceService, name: str, out: JobOutput) -> Response:
    t0 = time.perf_counter()
    resp = Response(_body(out), media_type="application/json")
    service.observe(name, "serialise", time.perf_counter() - t0)
    return resp


INLINE_DECODE_PIXELS = 256 * 256  # smaller images are decoded on the event loop (cheap)
OVERLAY_MIN_SIDE = 256  # an overlay is drawn on the image decoded at least this large


def _headers(items: list[tuple[bytes, str | None]], max_pixels: int,
             max_request_pixels: int) -> list[tuple[int, int]]:
    """Every image's size from its header alone: the format allow-list, the per-image and
    the per-request pixel budgets are checked before anything is decoded."""
    sizes, total = [], 0
    for i, (data, filename) in enumerate(items):
        what = f"image {i}" + (f" ({filename})" if filename else "")
        if not data:
            raise BadInputError(f"{what} is empty")
        try:
            _, w, h = image_header(data)
        except ImageTooLargeError as e:
            raise PayloadTooLargeError(f"{what}: {e}") from e
        except ImageDecodeError as e:
            raise BadInputError(f"{what}: {e}") from e
        if w * h > max_pixels:
            raise PayloadTooLargeError(
                f"{what} is {w}x{h} = {w * h} pixels; the limit is {max_pixels}")
        total += w * h
        if total > max_request_pixels:
            raise PayloadTooLargeError(
                f"the images add up to more than {max_request_pixels} pixels per request; "
                "split the request")
        sizes.append((w, h))
    return sizes


def _decode_all(items: list[tuple[bytes, str | None]], sizes: list[tuple[int, int]],
                max_pixels: int, min_side: int) -> list[ImageInput]:
    out = []
    for i, ((data, filename), (w, h)) in enumerate(zip(items, sizes, strict=True)):
        what = f"image {i}" + (f" ({filename})" if filename else "")
        try:
            img = decode_image(data, max_pixels=max_pixels, min_side=min_side)
            if (img.width - img.height) * (w - h) < 0:  # turned upright by its EXIF tag
                w, h = h, w
            out.append(ImageInput(img, filename, width=w, height=h))
        except ImageTooLargeError as e:
            raise PayloadTooLargeError(f"{what}: {e}") from e
        except ImageDecodeError as e:
            raise BadInputError(f"{what}: {e}") from e
    return out


@router.post(
    "/image",
    response_model=ImagePredictResponse,
    summary="Classify images, with attention maps",
    openapi_extra=_IMAGE_BODY,
    responses=error_responses(400, 404, 413, 415, 422, 503),
)
async def predict_image(
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    service: ServiceDep,
    model: Annotated[str | None, Query(min_length=1, max_length=200,
                                       description="served model name")] = None,
    top_k: Annotated[int, Query(ge=1, le=1000, description="classes per image")] = 5,
    attention: Annotated[list[AttentionKind], Query(
        description="maps to return; repeat to combine, e.g. attention=heads&attention=relevance"
    )] = [AttentionKind.rollout],  # noqa: B006 - FastAPI copies query defaults
    overlay: Annotated[bool, Query(description="also return a PNG heatmap overlay")] = False,
    faithfulness: Annotated[bool, Query(
        description="also return deletion/insertion curves of the maps against a random order"
    )] = False,
    target: Annotated[str | None, Query(
        max_length=200, description="class label or index to explain (relevance, "
        "faithfulness); default: the predicted class")] = None,
    encoding: Annotated[AttentionEncoding, Query(
        description="attention arrays as JSON lists (json) or base64 float16 (f16-base64)"
    )] = AttentionEncoding.json,
) -> Response:
    """Multipart ``file`` field(s) or a raw ``image/png`` / ``image/jpeg`` body. Any size or
    mode; each image is converted to RGB, resized to the model's input size and normalised with
    the model's own mean/std."""
    name = model or settings.default_image_model
    served = loaded_model(store, name, "image")  # 404 / 503 / 422 before reading the body
    spec = build_spec(attention, faithfulness, target, served.class_names)
    check_relevance(served, spec)
    if overlay and not spec.maps:
        raise InvalidRequestError("overlay=true needs attention maps (attention != none)")
    service.admit(lane_of(spec))  # shed before reading and decoding the body
    items = await _read_images(request, settings.max_items_per_request)
    if len(items) > settings.max_items_per_request:
        raise InvalidRequestError(f"at most {settings.max_items_per_request} images per request")
    check_explain_size(spec, len(items), settings.max_explain_items, "images")
    t0 = time.perf_counter()
    sizes = _headers(items, settings.max_image_pixels, settings.max_request_pixels)
    side = int(served.bundle.meta.preprocess["image_size"])
    min_side = max(side, OVERLAY_MIN_SIDE) if overlay else side
    if all(w * h <= INLINE_DECODE_PIXELS for w, h in sizes):
        inputs = _decode_all(items, sizes, settings.max_image_pixels, min_side)
    else:  # large images: decode in the thread pool (PIL releases the GIL)
        inputs = await run_in_threadpool(_decode_all, items, sizes, settings.max_image_pixels,
                                         min_side)
    service.observe(name, "decode", time.perf_counter() - t0)
    out = await service.predict(name, ImageJob(inputs, top_k, spec, overlay,
                                               encoding is AttentionEncoding.f16_base64))
    return _respond(service, name, out)


@router.post(
    "/text",
    response_model=TextPredictResponse,
    summary="Classify texts, with attention over tokens",
    dependencies=[JsonBodyDep],
    responses=error_responses(404, 413, 415, 422, 503),
)
async def predict_text(
    body: TextPredictRequest,
    settings: SettingsDep,
    store: StoreDep,
    service: ServiceDep,
) -> Response:
    """``{"text": "..." | ["...", ...], "model": ..., "top_k": 2, "attention": "rollout"}``.
    Texts longer than the model's ``max_len`` tokens are truncated (``truncated: true``)."""
    name = body.model or settings.default_text_model
    texts = body.texts
    if len(texts) > settings.max_items_per_request:
        raise InvalidRequestError(f"at most {settings.max_items_per_request} texts per request")
    for i, t in enumerate(texts):
        if len(t) > settings.max_text_chars:
            raise InvalidRequestError(
                f"text {i} has {len(t)} characters; the limit is {settings.max_text_chars}"
            )
    served = loaded_model(store, name, "text")
    spec = build_spec(body.attention, body.faithfulness, body.target, served.class_names)
    check_relevance(served, spec)
    check_explain_size(spec, len(texts), settings.max_explain_items, "texts")  # 422 first:
    service.admit(lane_of(spec), len(texts))  # an invalid request is never a 503 under load
    out = await service.predict(name, TextJob(texts, body.top_k, spec,
                                              body.encoding is AttentionEncoding.f16_base64))
    return _respond(service, name, out)
