"""Running batches: preprocessing from the bundle's metadata, one forward pass, predictions and
attention maps split back per request.

Everything here is blocking and runs in the single inference thread (so the event loop stays
free and torch's own threads are not oversubscribed). Within a batch, jobs are run in up to
three groups by what they asked for: no maps (the fused fast path), attention maps
(``forward_with_attention``: explicit attention, weights returned from the very pass that gives
the logits), and relevance (the same pass with the weights kept in the graph and one backward to
them, :func:`vit_service.explain.explain`). Faithfulness curves, where asked for, run their
perturbed inputs in batched forwards right after their group.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from serving.batching import MicroBatcher
from serving.compiled import eager_forwards
from serving.errors import InvalidRequestError, ModelNotLoadedError, OverloadedError
from serving.explanations import (
    ExplainSpec,
    faithfulness_dict,
    relevance_refused,
    scored_maps,
)
from serving.metrics import ServingMetrics
from serving.model_store import LoadedModel, ModelStore
from vit_service.attention_maps import AttentionMaps, compute_attention_maps, overlay_heatmap
from vit_service.config import Settings
from vit_service.explain import explain, faithfulness_curves, image_probs_fn, text_probs_fn
from vit_service.precision import inference_precision
from vit_service.preprocess import images_to_tensor

log = logging.getLogger(__name__)


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


@dataclass
class TextJob:
    texts: list[str]
    top_k: int
    spec: ExplainSpec
    f16: bool = False  # attention arrays as f16-base64 (EncodedArray) instead of JSON lists

    @property
    def size(self) -> int:
        return len(self.texts)


Job = ImageJob | TextJob


@dataclass
class JobOutput:
    model: LoadedModel  # the version that computed these results
    results: list[dict[str, Any]]  # ImageResult / TextResult fields, one per input


@dataclass
class Forward:
    """One group's forward: probabilities ``(B, K)``, maps (None on the fused path),
    relevance ``(B, *S)`` and the explained class per item ``(B,)`` (None without it)."""

    probs: torch.Tensor
    maps: AttentionMaps | None
    relevance: torch.Tensor | None
    target: torch.Tensor | None


Observe = Callable[[str, float], None]  # (stage, seconds) -> metrics


def _no_observe(stage: str, seconds: float) -> None:
    pass


class _Clock:
    """Laps of one batch group, reported per stage."""

    def __init__(self, observe: Observe) -> None:
        self.observe, self.t = observe, time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.observe(stage, now - self.t)
        self.t = now


def _predictions(probs: torch.Tensor, top_k: int, class_names: list[str]) -> list[dict[str, Any]]:
    """``probs`` ``(K,)`` -> top-k ``{"label", "index", "probability"}``, most probable first."""
    p, idx = probs.topk(min(top_k, probs.shape[-1]))
    return [
        {"label": class_names[i], "index": i, "probability": v}
        for v, i in zip(p.tolist(), idx.tolist(), strict=True)
    ]


def f16_base64(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as :class:`serving.schemas.EncodedArray` fields: little-endian float16 bytes,
    row-major, in base64."""
    a = t.detach().to(torch.float16).contiguous().numpy().astype("<f2", copy=False)
    return {"dtype": "float16", "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode("ascii")}


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


def _groups(jobs: Sequence[Job]) -> dict[int, list[int]]:
    """Job indices by forward path (fused / explicit attention / with gradients)."""
    out: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        out.setdefault(job.spec.path, []).append(i)
    return out


def _targets(jobs: Sequence[Job], idxs: list[int]) -> torch.Tensor:
    """Per input row, the requested class or -1 (= the predicted one)."""
    return torch.tensor([-1 if jobs[i].spec.target is None else jobs[i].spec.target
                         for i in idxs for _ in range(jobs[i].size)], dtype=torch.long)


def _forward(model: LoadedModel, jobs: Sequence[Job], idxs: list[int], path: int,
             inputs: tuple[torch.Tensor, ...], mask: torch.Tensor | None,
             clock: _Clock) -> Forward:
    """Run one group through the model's fused, explicit or gradient path."""
    net = model.bundle.model
    fwd = model.forwards or eager_forwards(net)  # traced when the store could (checked)
    heads = any(jobs[i].spec.heads for i in idxs)
    rel = target = None
    with torch.inference_mode():
        if path == 2:  # in the served precision, so its probabilities are the plain path's
            with inference_precision(net, model.precision):
                ex = explain(net, inputs, _targets(jobs, idxs), mask, model.grid, model.query)
            logits, target = ex.logits, ex.target
            attn, rel = ex.attn.float(), ex.relevance.float()
        elif path == 1:
            logits, attn = fwd.with_attention(*inputs)  # attn (L, B, H, T, T)
        else:
            logits, attn = fwd.plain(*inputs), None
        probs = logits.float().softmax(-1)  # (B, K)
        clock.lap("relevance" if path == 2 else "forward")
        maps = None if attn is None else compute_attention_maps(
            attn, attention_mask=mask, grid=model.grid, with_heads=heads, query=model.query)
        if maps is not None:
            clock.lap("maps")
    return Forward(probs, maps, rel, target)


def _failure(model: LoadedModel, path: int, e: Exception) -> Exception:
    """What a failed group answers. A failing relevance pass is the model's limit, not the
    request's fault nor a crash: the version is marked unable to give relevance (later
    requests get the 422 up front, the card says so) and this one gets that 422 too."""
    if path == 2 and not isinstance(e, InvalidRequestError):
        reason = f"its relevance pass failed in {model.precision} ({type(e).__name__})"
        model.mark_relevance_unavailable(reason)
        return relevance_refused(model.name, reason)
    return e


def _explained(fwd: Forward, jobs: Sequence[Job], idxs: list[int]) -> torch.Tensor:
    """Per input row, the class faithfulness follows: relevance's target, else the requested
    one, else the predicted one."""
    if fwd.target is not None:
        return fwd.target
    req = _targets(jobs, idxs)
    return torch.where(req < 0, fwd.probs.argmax(-1), req)


def _faithfulness(
    model: LoadedModel, jobs: Sequence[Job], idxs: list[int], fwd: Forward,
    probs_fn: Callable[[list[int], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
    valid: torch.Tensor, removal: str,
) -> dict[int, dict[str, Any]]:
    """Faithfulness dicts by input row, for the jobs of the group that asked for them."""
    rows = [r for r, i in enumerate(i for i in idxs for _ in range(jobs[i].size))
            if jobs[i].spec.faithfulness]
    if not rows or fwd.maps is None:
        return {}
    target = _explained(fwd, jobs, idxs)[rows]
    p_full = fwd.probs[rows].gather(1, target[:, None])[:, 0]
    maps = scored_maps(fwd.maps.rollout, fwd.relevance, rows)
    with torch.inference_mode(), inference_precision(model.bundle.model, model.precision):
        curves = faithfulness_curves(maps, valid[rows], probs_fn(rows, target), p_full)
    names = model.bundle.meta.class_names
    return {row: faithfulness_dict(curves, k, int(target[k]), names, removal)
            for k, row in enumerate(rows)}


def _target_ref(fwd: Forward, row: int, names: list[str]) -> dict[str, Any] | None:
    if fwd.target is None:
        return None
    t = int(fwd.target[row])
    return {"label": names[t], "index": t}


def run_image_jobs(model: LoadedModel, jobs: list[ImageJob],
                   observe: Observe = _no_observe) -> list[JobOutput | Exception]:
    net, meta = model.bundle.model, model.bundle.meta
    names = meta.class_names
    outputs: list[JobOutput | Exception] = [InvalidRequestError("not run")] * len(jobs)
    for path, idxs in _groups(jobs).items():
        try:
            clock = _Clock(observe)
            images = [inp.image for i in idxs for inp in jobs[i].inputs]
            x = images_to_tensor(images, meta)  # (B, 3, S, S)
            clock.lap("preprocess")
            fwd = _forward(model, jobs, idxs, path, (x,), None, clock)
            maps = fwd.maps
            gh, gw = model.grid or (1, 1)
            faith = _faithfulness(
                model, jobs, idxs, fwd,
                lambda rows, tgt, x=x, p=x.shape[-1] // gw: image_probs_fn(net, x[rows], tgt, p),
                torch.ones(x.shape[0], gh * gw, dtype=torch.bool), "mean_colour")
            if faith:
                clock.lap("faithfulness")
            rollout = _Arrays(maps.rollout if maps else None)
            layers = _Arrays(maps.layers if maps else None)
            heads = _Arrays(maps.heads if maps else None)
            rel = _Arrays(fwd.relevance)
            row = 0
            for i in idxs:
                job, results = jobs[i], []
                for inp in job.inputs:
                    res: dict[str, Any] = {
                        "filename": inp.filename,
                        "width": inp.width or inp.image.width,
                        "height": inp.height or inp.image.height,
                        "predictions": _predictions(fwd.probs[row], job.top_k, names),
                        "attention": None,
                        "overlay_png": None,
                        "faithfulness": faith.get(row),
                    }
                    if maps is not None:
                        f16 = job.f16
                        res["attention"] = {
                            "grid": model.grid,
                            "rollout": rollout.row(row, f16),
                            "layers": layers.row(row, f16),
                            "heads": heads.row(row, f16) if job.spec.heads else None,
                            "relevance": rel.row(row, f16),
                            "target": _target_ref(fwd, row, names),
                        }
                        if job.overlay:
                            heat = (fwd.relevance if job.spec.primary == "relevance"
                                    and fwd.relevance is not None else maps.rollout)[row]
                            png = overlay_heatmap(inp.image, heat)
                            res["overlay_png"] = base64.b64encode(png).decode("ascii")
                    results.append(res)
                    row += 1
                outputs[i] = JobOutput(model, results)
            clock.lap("results")
        except Exception as e:
            log.exception("image batch failed for %s", model.name)
            for i in idxs:
                outputs[i] = _failure(model, path, e)
    return outputs


def run_text_jobs(model: LoadedModel, jobs: list[TextJob],
                  observe: Observe = _no_observe) -> list[JobOutput | Exception]:
    net, meta, tok = model.bundle.model, model.bundle.meta, model.bundle.tokenizer
    names = meta.class_names
    outputs: list[JobOutput | Exception] = [InvalidRequestError("not run")] * len(jobs)
    max_len = int(meta.preprocess["max_len"])
    truncation = meta.preprocess.get("truncation", "head")  # as the model was trained
    prefix = getattr(net, "num_prefix_tokens", 1)
    for path, idxs in _groups(jobs).items():
        try:
            clock = _Clock(observe)
            texts = [t for i in idxs for t in jobs[i].texts]
            enc = tok.encode_batch(texts, max_len, truncation)  # [CLS] + pieces, padded
            ids, mask = enc.input_ids, enc.attention_mask  # (B, T), (B, T) True = real
            clock.lap("preprocess")
            fwd = _forward(model, jobs, idxs, path, (ids, mask), mask, clock)
            maps = fwd.maps
            faith = _faithfulness(
                model, jobs, idxs, fwd,
                lambda rows, tgt, ids=ids, mask=mask: text_probs_fn(
                    net, ids[rows], mask[rows], tgt, prefix),
                mask[:, prefix:], "attention_mask")
            if faith:
                clock.lap("faithfulness")
            lengths = mask.sum(1).tolist()
            rollout = _Arrays(maps.rollout if maps else None)
            layers = _Arrays(maps.layers if maps else None)
            heads = _Arrays(maps.heads if maps else None)
            rel = _Arrays(fwd.relevance)
            row = 0
            for i in idxs:
                job, results = jobs[i], []
                for _ in job.texts:
                    n = int(lengths[row]) - 1  # real tokens after [CLS]
                    res: dict[str, Any] = {
                        "predictions": _predictions(fwd.probs[row], job.top_k, names),
                        "tokens": enc.tokens(row)[1:],
                        "truncated": bool(enc.truncated[row]),
                        "attention": None,
                        "faithfulness": faith.get(row),
                    }
                    if maps is not None:
                        f16 = job.f16
                        res["attention"] = {
                            "rollout": rollout.row(row, f16, n),
                            "layers": layers.row(row, f16, n),
                            "heads": heads.row(row, f16, n) if job.spec.heads else None,
                            "relevance": rel.row(row, f16, n),
                            "target": _target_ref(fwd, row, names),
                        }
                    results.append(res)
                    row += 1
                outputs[i] = JobOutput(model, results)
            clock.lap("results")
        except Exception as e:
            log.exception("text batch failed for %s", model.name)
            for i in idxs:
                outputs[i] = _failure(model, path, e)
    return outputs


PLAIN, EXPLAIN = "plain", "explain"
COST_ALPHA = 0.2  # weight of the newest batch in the moving average of seconds per input


def lane_of(spec: ExplainSpec) -> str:
    """Relevance and faithfulness cost a backward pass or ~55 forwards per input: a lane of
    their own, with its own admission cap and small batches."""
    return EXPLAIN if spec.relevance or spec.faithfulness else PLAIN


class InferenceService:
    """One micro-batcher per served model and lane, all feeding one inference thread.

    Admission: the inputs admitted and not yet answered are counted per lane, and each lane
    keeps a moving average of the seconds one input costs; a request that would take its lane
    past ``max_queued_items`` / ``max_queued_explain_items``, or whose estimated wait (inputs
    ahead x seconds per input) passes ``max_queue_wait_s``, gets 503 with ``Retry-After`` at
    once (the routes ask before reading the body, and again with the exact size), and one not
    answered within ``request_timeout_s`` gets 503 too (its job is skipped if its batch has
    not started). The one inference thread takes batches
    from the lanes' batchers in turn, and an explain batch holds at most ``explain_batch_size``
    inputs, so plain predictions stay responsive while explanations are queued."""

    def __init__(
        self, store: ModelStore, settings: Settings, metrics: ServingMetrics | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._batchers: dict[tuple[str, str], MicroBatcher[Job, JobOutput]] = {}
        self.queued = {PLAIN: 0, EXPLAIN: 0}  # inputs admitted and not yet answered
        self.per_input_s: dict[str, float | None] = {PLAIN: None, EXPLAIN: None}

    def _cap(self, lane_: str) -> int:
        s = self.settings
        return s.max_queued_explain_items if lane_ == EXPLAIN else s.max_queued_items

    def batcher(self, name: str, lane_: str = PLAIN) -> MicroBatcher[Job, JobOutput]:
        b = self._batchers.get((name, lane_))
        if b is None:
            def on_batch(n: int, seconds: float, name: str = name, ln: str = lane_) -> None:
                cost, prev = seconds / max(1, n), self.per_input_s[ln]
                self.per_input_s[ln] = cost if prev is None else prev + COST_ALPHA * (cost - prev)
                if self.metrics is not None:
                    self.metrics.batch_size.labels(name).observe(n)
                    self.metrics.batch_seconds.labels(name).observe(seconds)

            def on_wait(seconds: float, name: str = name) -> None:
                self.observe(name, "queue", seconds)

            size = self.settings.max_batch_size
            if lane_ == EXPLAIN:
                size = min(size, self.settings.explain_batch_size)
            b = MicroBatcher(
                f"{name}/{lane_}", lambda jobs, name=name: self._process(name, jobs),
                self.executor, size, self.settings.max_wait_ms, on_batch, on_wait,
                adaptive=self.settings.adaptive_wait,
            )
            self._batchers[(name, lane_)] = b
        return b

    def observe(self, name: str, stage: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.stage_seconds.labels(name, stage).observe(seconds)

    def _process(self, name: str, jobs: list[Job]) -> list[JobOutput | Exception]:
        model = self.store.get(name)  # the version current when the batch starts
        if model is None:
            return [ModelNotLoadedError(name)] * len(jobs)
        want = ImageJob if model.task == "image" else TextJob
        if not all(isinstance(j, want) for j in jobs):
            return [InvalidRequestError(f"model {name!r} is a {model.task} model")] * len(jobs)
        # a target was checked against the version current at request time; a reload since
        # may have fewer classes: fail only those jobs
        n = len(model.class_names)
        bad = {i for i, j in enumerate(jobs) if j.spec.target is not None and j.spec.target >= n}
        if bad:
            ok = [j for i, j in enumerate(jobs) if i not in bad]
            done = iter(self._run(model, ok) if ok else [])
            return [InvalidRequestError(f"target index {j.spec.target} is not a class of "
                                        f"{name!r} v{model.version}") if i in bad else next(done)
                    for i, j in enumerate(jobs)]
        return self._run(model, jobs)

    def _run(self, model: LoadedModel, jobs: list[Job]) -> list[JobOutput | Exception]:
        name = model.name

        def observe(stage: str, seconds: float) -> None:
            self.observe(name, stage, seconds)

        if model.task == "image":
            return run_image_jobs(model, jobs, observe)  # type: ignore[arg-type]
        return run_text_jobs(model, jobs, observe)  # type: ignore[arg-type]

    def admit(self, ln: str, size: int = 1) -> None:
        """503 with Retry-After if ``size`` more inputs would overfill lane ``ln``: past its cap
        in inputs, or past ``max_queue_wait_s`` of estimated wait."""
        cap = self._cap(ln)
        if self.queued[ln] + size > cap:
            self._shed(ln, "full")
            raise OverloadedError(f"the {ln} queue is full ({self.queued[ln]} of {cap} inputs "
                                  "waiting); retry shortly", retry_after_s=1)
        per = self.per_input_s[ln]
        wait = (self.queued[ln] + size) * per if per is not None else 0.0
        if wait > self.settings.max_queue_wait_s:
            self._shed(ln, "wait")
            raise OverloadedError(f"the {ln} queue would hold this request ~{wait:.1f}s; retry "
                                  "shortly", retry_after_s=math.ceil(wait))

    async def predict(self, name: str, job: Job) -> JobOutput:
        ln = lane_of(job.spec)
        self.admit(ln, job.size)
        self._count(ln, job.size)
        try:
            return await asyncio.wait_for(self.batcher(name, ln).submit(job, job.size),
                                          self.settings.request_timeout_s)
        except TimeoutError:
            self._shed(ln, "deadline")
            raise OverloadedError(f"not answered within {self.settings.request_timeout_s:g}s "
                                  "(the server is busy); retry shortly",
                                  retry_after_s=2) from None
        finally:
            self._count(ln, -job.size)

    def _count(self, ln: str, n: int) -> None:
        self.queued[ln] += n
        if self.metrics is not None:
            self.metrics.queue_items.labels(ln).set(self.queued[ln])

    def _shed(self, ln: str, why: str) -> None:
        if self.metrics is not None:
            self.metrics.shed.labels(ln, why).inc()

    async def close(self) -> None:
        for b in self._batchers.values():
            await b.close()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
