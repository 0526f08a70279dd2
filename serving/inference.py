"""Running batches: preprocessing from the bundle's metadata, one forward pass, predictions and
attention maps split back per request.

Everything here is blocking and runs in the single inference thread (so the event loop stays
free and torch's own threads are not oversubscribed). Within a batch, jobs that asked for
attention and jobs that did not are run as two groups: the first through
``forward_with_attention`` (explicit attention, weights returned from the very pass that gives
the logits), the second through the fused fast path.
"""

from __future__ import annotations

import base64
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from serving.batching import MicroBatcher
from serving.errors import InvalidRequestError, ModelNotLoadedError
from serving.metrics import ServingMetrics
from serving.model_store import LoadedModel, ModelStore
from serving.schemas import AttentionKind
from vit_service.attention_maps import compute_attention_maps, overlay_heatmap
from vit_service.config import Settings
from vit_service.preprocess import images_to_tensor

log = logging.getLogger(__name__)


@dataclass
class ImageInput:
    image: Image.Image  # decoded RGB, original size
    filename: str | None = None


@dataclass
class ImageJob:
    inputs: list[ImageInput]
    top_k: int
    attention: AttentionKind
    overlay: bool = False

    @property
    def size(self) -> int:
        return len(self.inputs)


@dataclass
class TextJob:
    texts: list[str]
    top_k: int
    attention: AttentionKind

    @property
    def size(self) -> int:
        return len(self.texts)


Job = ImageJob | TextJob


@dataclass
class JobOutput:
    model: LoadedModel  # the version that computed these results
    results: list[dict[str, Any]]  # ImageResult / TextResult fields, one per input


def _predictions(probs: torch.Tensor, top_k: int, class_names: list[str]) -> list[dict[str, Any]]:
    """``probs`` ``(K,)`` -> top-k ``{"label", "index", "probability"}``, most probable first."""
    p, idx = probs.topk(min(top_k, probs.shape[-1]))
    return [
        {"label": class_names[i], "index": i, "probability": v}
        for v, i in zip(p.tolist(), idx.tolist(), strict=True)
    ]


def _groups(jobs: list[Job]) -> dict[bool, list[int]]:
    """Job indices by whether they need attention maps (two forward paths)."""
    out: dict[bool, list[int]] = {}
    for i, job in enumerate(jobs):
        out.setdefault(job.attention != AttentionKind.none, []).append(i)
    return out


def run_image_jobs(model: LoadedModel, jobs: list[ImageJob]) -> list[JobOutput | Exception]:
    net, meta = model.bundle.model, model.bundle.meta
    outputs: list[JobOutput | Exception] = [InvalidRequestError("not run")] * len(jobs)
    for need_attn, idxs in _groups(list(jobs)).items():
        try:
            images = [inp.image for i in idxs for inp in jobs[i].inputs]
            x = images_to_tensor(images, meta)  # (B, 3, S, S)
            with torch.inference_mode():
                if need_attn:
                    logits, attn = net.forward_with_attention(x)  # attn (L, B, H, T, T)
                else:
                    logits, attn = net(x), None
                probs = logits.float().softmax(-1)  # (B, K)
                maps = None
                if attn is not None:
                    heads = any(jobs[i].attention == AttentionKind.heads for i in idxs)
                    maps = compute_attention_maps(attn, grid=model.grid, with_heads=heads,
                                                  query=model.query)
            rollout = maps.rollout.tolist() if maps else None
            layers = maps.layers.tolist() if maps else None
            head_list = maps.heads.tolist() if maps and maps.heads is not None else None
            row = 0
            for i in idxs:
                job, results = jobs[i], []
                for inp in job.inputs:
                    res: dict[str, Any] = {
                        "filename": inp.filename,
                        "width": inp.image.width,
                        "height": inp.image.height,
                        "predictions": _predictions(probs[row], job.top_k, meta.class_names),
                        "attention": None,
                        "overlay_png": None,
                    }
                    if maps is not None:
                        res["attention"] = {
                            "grid": model.grid,
                            "rollout": rollout[row],
                            "layers": layers[row],
                            "heads": head_list[row] if (
                                head_list is not None and job.attention == AttentionKind.heads
                            ) else None,
                        }
                        if job.overlay:
                            png = overlay_heatmap(inp.image, maps.rollout[row])
                            res["overlay_png"] = base64.b64encode(png).decode("ascii")
                    results.append(res)
                    row += 1
                outputs[i] = JobOutput(model, results)
        except Exception as e:
            log.exception("image batch failed for %s", model.name)
            for i in idxs:
                outputs[i] = e
    return outputs


def run_text_jobs(model: LoadedModel, jobs: list[TextJob]) -> list[JobOutput | Exception]:
    net, meta, tok = model.bundle.model, model.bundle.meta, model.bundle.tokenizer
    outputs: list[JobOutput | Exception] = [InvalidRequestError("not run")] * len(jobs)
    max_len = int(meta.preprocess["max_len"])
    truncation = meta.preprocess.get("truncation", "head")  # as the model was trained
    for need_attn, idxs in _groups(list(jobs)).items():
        try:
            texts = [t for i in idxs for t in jobs[i].texts]
            enc = tok.encode_batch(texts, max_len, truncation)  # [CLS] + pieces, padded
            ids, mask = enc.input_ids, enc.attention_mask  # (B, T), (B, T) True = real
            with torch.inference_mode():
                if need_attn:
                    logits, attn = net.forward_with_attention(ids, mask)
                else:
                    logits, attn = net(ids, mask), None
                probs = logits.float().softmax(-1)
                maps = None
                if attn is not None:
                    heads = any(jobs[i].attention == AttentionKind.heads for i in idxs)
                    maps = compute_attention_maps(attn, attention_mask=mask, with_heads=heads,
                                                  query=model.query)
            lengths = mask.sum(1).tolist()
            row = 0
            for i in idxs:
                job, results = jobs[i], []
                for _ in job.texts:
                    n = int(lengths[row]) - 1  # real tokens after [CLS]
                    res: dict[str, Any] = {
                        "predictions": _predictions(probs[row], job.top_k, meta.class_names),
                        "tokens": enc.tokens(row)[1:],
                        "truncated": bool(enc.truncated[row]),
                        "attention": None,
                    }
                    if maps is not None:
                        res["attention"] = {
                            "rollout": maps.rollout[row, :n].tolist(),
                            "layers": maps.layers[row, :, :n].tolist(),
                            "heads": maps.heads[row, :, :, :n].tolist() if (
                                maps.heads is not None and job.attention == AttentionKind.heads
                            ) else None,
                        }
                    results.append(res)
                    row += 1
                outputs[i] = JobOutput(model, results)
        except Exception as e:
            log.exception("text batch failed for %s", model.name)
            for i in idxs:
                outputs[i] = e
    return outputs


class InferenceService:
    """One micro-batcher per served model, all feeding one inference thread."""

    def __init__(
        self, store: ModelStore, settings: Settings, metrics: ServingMetrics | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._batchers: dict[str, MicroBatcher[Job, JobOutput]] = {}

    def batcher(self, name: str) -> MicroBatcher[Job, JobOutput]:
        b = self._batchers.get(name)
        if b is None:
            def on_batch(n: int, seconds: float, name: str = name) -> None:
                if self.metrics is not None:
                    self.metrics.batch_size.labels(name).observe(n)
                    self.metrics.batch_seconds.labels(name).observe(seconds)

            b = MicroBatcher(
                name, lambda jobs, name=name: self._process(name, jobs), self.executor,
                self.settings.max_batch_size, self.settings.max_wait_ms, on_batch,
            )
            self._batchers[name] = b
        return b

    def _process(self, name: str, jobs: list[Job]) -> list[JobOutput | Exception]:
        model = self.store.get(name)  # the version current when the batch starts
        if model is None:
            return [ModelNotLoadedError(name)] * len(jobs)
        want = ImageJob if model.task == "image" else TextJob
        if not all(isinstance(j, want) for j in jobs):
            return [InvalidRequestError(f"model {name!r} is a {model.task} model")] * len(jobs)
        if model.task == "image":
            return run_image_jobs(model, jobs)  # type: ignore[arg-type]
        return run_text_jobs(model, jobs)  # type: ignore[arg-type]

    async def predict(self, name: str, job: Job) -> JobOutput:
        return await self.batcher(name).submit(job, job.size)

    async def close(self) -> None:
        for b in self._batchers.values():
            await b.close()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
