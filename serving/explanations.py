"""What a prediction request asks to be explained, validated before it is queued.

A request's options become an :class:`ExplainSpec` (:mod:`vit_service.pipeline`) here, so a bad
combination is a 422 and never reaches the inference thread. The maths lives in
:mod:`vit_service.explain` and :mod:`vit_service.pipeline`; the answer is formatted by
:mod:`serving.codecs`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from serving.errors import InvalidRequestError
from serving.schemas import AttentionKind
from vit_service.pipeline import ExplainSpec

__all__ = ["ExplainSpec", "build_spec", "check_explain_size", "check_relevance",
           "relevance_refused", "resolve_target"]


def resolve_target(target: str | int | None, class_names: list[str]) -> int | None:
    """A label or an index (as int or digit string) -> class index; 422 if unknown."""
    if target is None:
        return None
    if isinstance(target, str) and target in class_names:
        return class_names.index(target)
    text = target.strip() if isinstance(target, str) else None
    if isinstance(target, int) or (text and len(text) <= 6 and text.isascii()
                                   and text.isdecimal()):
        i = int(target)
        if 0 <= i < len(class_names):
            return i
    raise InvalidRequestError(
        f"unknown target {target!r}; use a class label ({', '.join(class_names)}) or an index "
        f"0..{len(class_names) - 1}"
    )


def build_spec(
    kinds: AttentionKind | Iterable[AttentionKind],
    faithfulness: bool,
    target: str | int | None,
    class_names: list[str],
) -> ExplainSpec:
    """Validate a request's combination of options; 422 with the reason if it makes no sense."""
    ks = {kinds} if isinstance(kinds, AttentionKind) else set(kinds)
    if not ks:
        ks = {AttentionKind.rollout}
    if AttentionKind.none in ks and len(ks) > 1:
        raise InvalidRequestError("attention=none cannot be combined with other kinds")
    maps = AttentionKind.none not in ks
    if faithfulness and not maps:
        raise InvalidRequestError("faithfulness=true needs attention maps (attention != none)")
    relevance = AttentionKind.relevance in ks
    if target is not None and not (relevance or faithfulness):
        raise InvalidRequestError("target only applies to attention=relevance or "
                                  "faithfulness=true")
    return ExplainSpec(maps, AttentionKind.heads in ks, relevance, faithfulness,
                       resolve_target(target, class_names))


def check_explain_size(spec: ExplainSpec, n: int, limit: int, what: str) -> None:
    """Relevance and faithfulness cost a backward pass / ~55-73 forwards per item: cap them."""
    if (spec.relevance or spec.faithfulness) and n > limit:
        raise InvalidRequestError(f"at most {limit} {what} per request with attention=relevance "
                                  f"or faithfulness=true (got {n}); split the request")


def relevance_refused(name: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"model {name!r} cannot give relevance: {reason}; ask "
                               "attention=rollout (predictions and rollout maps still work)")


def check_relevance(model: Any, spec: ExplainSpec) -> None:
    """422 up front when relevance is asked of a version that cannot give it (its load-time
    probe, or an earlier request, found its relevance pass failing)."""
    reason = model.relevance_unavailable
    if spec.relevance and reason is not None:
        raise relevance_refused(model.name, reason)
