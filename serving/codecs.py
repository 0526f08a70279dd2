"""The two modalities' jobs, and how a batch of them is decoded into model inputs and each
answer encoded from :class:`vit_service.pipeline.ExplainResult` into the schema types.

One codec per modality (:data:`CODECS`), with the same two steps (LitServe style):
``batch(model, jobs)`` -> the model inputs of the whole group and what encoding needs of the
preprocessing; ``encode(...)`` -> one :class:`serving.schemas.ImageResult` /
:class:`serving.schemas.TextResult` per input. The answers are built with ``model_construct``
(no validation: the values come from the model, and ``serving.routers.predict`` writes them
with orjson in the schema's field order).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from serving.model_store import LoadedModel
from serving.schemas import (
    ClassRef,
    EncodedArray,
    Faithfulness,
    FaithfulnessCurve,
    ImageAttention,
    ImageResult,
    Prediction,
    TextAttention,
    TextResult,
)
from vit_service.attention_maps import overlay_heatmap
from vit_service.explain import FaithfulnessSummary
from vit_service.pipeline import ExplainResult, ExplainSpec, ImageInputs, TextInputs
from vit_service.preprocess import images_to_tensor


@dataclass
class ImageInput:
    image: Image.Image  # decoded RGB, reduced as far as the model's size allows
    filename: str | None = None
    width: int | None = None  # the upload's own size (None: the decoded image's)
    height: int | None = None


@dataclass
class ImageJob:
    inputs: list[ImageInput]
    top_k: int
    spec: ExplainSpec
    overlay: bool = False
    f16: bool = False  # attention arrays as f16-base64 (EncodedArray) instead of JSON lists

    @property
    def size(self) -> int:
        return len(self.inputs)

    @property
    def items(self) -> list[ImageInput]:
        return self.inputs


@dataclass
class TextJob:
    texts: list[str]
    top_k: int
    spec: ExplainSpec
    f16: bool = False  # attention arrays as f16-base64 (EncodedArray) instead of JSON lists

    @property
    def size(self) -> int:
        return len(self.texts)

    @property
    def items(self) -> list[str]:
        return self.texts


Job = ImageJob | TextJob
Result = ImageResult | TextResult


# --- arrays and shared fields ----------------------------------------------------------------


def f16_base64(t: torch.Tensor) -> EncodedArray:
    """A tensor as an :class:`EncodedArray`: little-endian float16 bytes, row-major, base64."""
    a = t.detach().to(torch.float16).contiguous().numpy().astype("<f2", copy=False)
    return EncodedArray.model_construct(dtype="float16", shape=list(a.shape),
                                        data=base64.b64encode(a.tobytes()).decode("ascii"))


class _Arrays:
    """One batch's attention array, per row: a float32 numpy array (written as JSON lists by
    the response encoder, float32's shortest form: ``0.0024467555``, not the 17 digits of
    the same number as a double) or f16-base64; ``n``: keep the first ``n`` of the last dim."""

    def __init__(self, t: torch.Tensor | None) -> None:
        self.t = t
        self._np: np.ndarray | None = None

    def row(self, i: int, f16: bool, n: int | None = None) -> Any:
        if self.t is None:
            return None
        if f16:
            return f16_base64(self.t[i] if n is None else self.t[i, ..., :n])
        if self._np is None:  # one conversion for the batch (a view: no copy on the CPU)
            self._np = self.t.detach().float().cpu().numpy()
        a = self._np[i] if n is None else self._np[i, ..., :n]
        return np.ascontiguousarray(a)  # (*grid) / (L, *grid) / (n,) ...; orjson wants C order


class BatchArrays:
    """A result's arrays, converted once per batch."""

    def __init__(self, res: ExplainResult) -> None:
        maps = res.maps
        self.rollout = _Arrays(maps.rollout if maps else None)
        self.layers = _Arrays(maps.layers if maps else None)
        self.heads = _Arrays(maps.heads if maps else None)
        self.relevance = _Arrays(res.relevance)
        self.ngram = _Arrays(res.ngram)

    def attention(self, row: int, job: Job, n: int | None = None) -> dict[str, Any]:
        """The arrays of an :class:`ImageAttention` / :class:`TextAttention`."""
        f16 = job.f16
        return {"rollout": self.rollout.row(row, f16, n), "layers": self.layers.row(row, f16, n),
                "heads": self.heads.row(row, f16, n) if job.spec.heads else None,
                "relevance": self.relevance.row(row, f16, n)}


def predictions(probs: torch.Tensor, top_k: int, class_names: list[str]) -> list[Prediction]:
    """``probs`` ``(K,)`` -> the top-k classes, most probable first."""
    p, idx = probs.topk(min(top_k, probs.shape[-1]))
    return [Prediction.model_construct(label=class_names[i], index=i, probability=v)
            for v, i in zip(p.tolist(), idx.tolist(), strict=True)]


def class_ref(index: int, class_names: list[str]) -> ClassRef:
    return ClassRef.model_construct(label=class_names[index], index=index)


def faithfulness(f: FaithfulnessSummary | None, class_names: list[str]) -> Faithfulness | None:
    if f is None:
        return None
    maps = {name: FaithfulnessCurve.model_construct(
        deletion=c.deletion, insertion=c.insertion, deletion_auc=c.deletion_auc,
        insertion_auc=c.insertion_auc) for name, c in f.maps.items()}
    return Faithfulness.model_construct(
        target=class_ref(f.target, class_names), fractions=f.fractions, removal=f.removal,
        maps=maps, deletion_ratio=f.deletion_ratio, most_faithful=f.most_faithful)


def _target(res: ExplainResult, row: int, class_names: list[str]) -> ClassRef | None:
    return None if res.target is None else class_ref(int(res.target[row]), class_names)


# --- the codecs ------------------------------------------------------------------------------


class ImageCodec:
    job_type: ClassVar[type] = ImageJob

    @staticmethod
    def batch(model: LoadedModel, jobs: list[ImageJob]) -> tuple[ImageInputs, None]:
        images = [inp.image for job in jobs for inp in job.inputs]
        return ImageInputs(images_to_tensor(images, model.bundle.meta)), None  # (B, 3, S, S)

    @staticmethod
    def encode(model: LoadedModel, job: ImageJob, inp: ImageInput, row: int,
               res: ExplainResult, arrays: BatchArrays, ctx: None) -> ImageResult:
        names = model.class_names
        attention = overlay = None
        if res.maps is not None:
            attention = ImageAttention.model_construct(
                grid=model.grid, **arrays.attention(row, job), target=_target(res, row, names))
            if job.overlay:
                heat = (res.relevance if job.spec.primary == "relevance"
                        and res.relevance is not None else res.maps.rollout)[row]
                overlay = base64.b64encode(overlay_heatmap(inp.image, heat)).decode("ascii")
        return ImageResult.model_construct(
            filename=inp.filename, width=inp.width or inp.image.width,
            height=inp.height or inp.image.height,
            predictions=predictions(res.probs[row], job.top_k, names), attention=attention,
            overlay_png=overlay, faithfulness=faithfulness(res.faithfulness.get(row), names))


@dataclass
class _TextContext:
    enc: Any  # the tokenizer's batch encoding: tokens(row), truncated
    lengths: list[int]  # real tokens per row, [CLS] included


class TextCodec:
    job_type: ClassVar[type] = TextJob

    @staticmethod
    def batch(model: LoadedModel, jobs: list[TextJob]) -> tuple[TextInputs, _TextContext]:
        meta, tok = model.bundle.meta, model.bundle.tokenizer
        texts = [t for job in jobs for t in job.texts]
        truncation = meta.preprocess.get("truncation", "head")  # as the model was trained
        enc = tok.encode_batch(texts, int(meta.preprocess["max_len"]), truncation)
        # [CLS] + pieces, padded: ids (B, T), mask (B, T) True = real
        return (TextInputs(enc.input_ids, enc.attention_mask),
                _TextContext(enc, enc.attention_mask.sum(1).tolist()))

    @staticmethod
    def encode(model: LoadedModel, job: TextJob, text: str, row: int, res: ExplainResult,
               arrays: BatchArrays, ctx: _TextContext) -> TextResult:
        names = model.class_names
        attention = None
        if res.maps is not None:
            n = int(ctx.lengths[row]) - 1  # real tokens after [CLS]
            attention = TextAttention.model_construct(
                **arrays.attention(row, job, n), ngram=arrays.ngram.row(row, job.f16, n),
                target=_target(res, row, names))
        return TextResult.model_construct(
            predictions=predictions(res.probs[row], job.top_k, names),
            tokens=ctx.enc.tokens(row)[1:], truncated=bool(ctx.enc.truncated[row]),
            attention=attention, faithfulness=faithfulness(res.faithfulness.get(row), names))


Codec = type[ImageCodec] | type[TextCodec]
CODECS: dict[str, Codec] = {"image": ImageCodec, "text": TextCodec}
