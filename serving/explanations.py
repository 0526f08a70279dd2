"""What a prediction request asks to be explained, and the faithfulness block of its answer.

The request side (:class:`ExplainSpec`) is validated here, before the request is queued, so a
bad combination is a 422 and never reaches the inference thread. The maths lives in
:mod:`vit_service.explain`; this module only turns its tensors into response dicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from serving.errors import InvalidRequestError
from serving.schemas import AttentionKind
from vit_service.explain import Curves


@dataclass(frozen=True)
class ExplainSpec:
    """``maps``: any attention at all (else the fused fast path); ``heads``: per-head maps;
    ``relevance``: the gradient pass; ``faithfulness``: deletion/insertion curves; ``target``:
    the class index to explain (None: the predicted class)."""

    maps: bool = True
    heads: bool = False
    relevance: bool = False
    faithfulness: bool = False
    target: int | None = None

    @property
    def path(self) -> int:
        """Forward path: 0 fused (no maps), 1 explicit attention, 2 explicit + gradients."""
        return 2 if self.relevance else int(self.maps)

    @property
    def primary(self) -> str:
        """The single map an overlay draws: relevance when asked for, else rollout."""
        return "relevance" if self.relevance else "rollout"


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
    """Relevance and faithfulness cost a backward pass / ~55 forwards per item: cap them."""
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


def faithfulness_dict(
    curves: dict[str, Curves], row: int, target: int, class_names: list[str], removal: str
) -> dict[str, Any]:
    """One item's :class:`serving.schemas.Faithfulness` fields from batched curves."""
    maps = {
        name: {
            "deletion": c.deletion[row].tolist(),
            "insertion": c.insertion[row].tolist(),
            "deletion_auc": float(c.deletion_auc[row]),
            "insertion_auc": float(c.insertion_auc[row]),
        }
        for name, c in curves.items()
    }
    rand = maps["random"]["deletion_auc"]
    if rand <= 1e-9:  # nothing to remove (no real token) or a class at probability 0
        ratio = {n: 1.0 for n in maps if n != "random"}
    else:
        ratio = {n: m["deletion_auc"] / rand for n, m in maps.items() if n != "random"}
    best = min(ratio, key=ratio.__getitem__) if ratio else "random"
    return {
        "target": {"label": class_names[target], "index": target},
        "fractions": curves["random"].fractions[row].tolist(),
        "removal": removal,
        "maps": maps,
        "deletion_ratio": ratio,
        "most_faithful": best if ratio.get(best, 1.0) < 1.0 else "random",
    }


def scored_maps(rollout: Tensor, relevance: Tensor | None, rows: list[int]
                ) -> dict[str, Tensor]:
    """The maps faithfulness scores for the items ``rows`` of a batch, each ``(n, N)``
    (relevance exists only on the gradient path, i.e. when it was asked for)."""
    out = {"rollout": rollout[rows].reshape(len(rows), -1)}
    if relevance is not None:
        out["relevance"] = relevance[rows].reshape(len(rows), -1)
    return out
