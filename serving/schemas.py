"""Request and response models of the REST API (they are the OpenAPI schema too)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from vit_service.data.tokenizer import text_problem


class AttentionKind(StrEnum):
    """Which attention maps a prediction returns (all from the prediction's own forward pass).

    ``none``: no maps (fused fast attention path). ``rollout`` and ``layers``: the rollout map
    and the per-layer maps (both are always returned together; they are cheap). ``heads``:
    additionally the per-layer, per-head maps. ``relevance``: additionally the gradient-weighted
    relevance of Chefer et al. (2021) for the predicted (or ``target``) class: one backward to
    the attention weights in the same pass. Kinds combine (``heads`` and ``relevance``).
    """

    none = "none"
    rollout = "rollout"
    layers = "layers"
    heads = "heads"
    relevance = "relevance"


# --- shared ------------------------------------------------------------------------------------


class ErrorResponse(BaseModel):
    """Every error: ``{"detail": "..."}`` (422 validation errors: a list of error objects)."""

    detail: str | list[dict]


class ModelInfo(BaseModel):
    """The model version that produced a response."""

    name: str = Field(description="served name (the `model` parameter)")
    task: Literal["image", "text"]
    version: str | None = Field(description="registered model version (None for local bundles)")
    alias: str | None = Field(description="registry alias it was resolved through, e.g. champion")
    run_id: str | None = Field(description="MLflow run that logged the model")
    source: str = Field(description="configured source, e.g. models:/cifar10-vit@champion")
    run_url: str | None = Field(None, description="link to the run in the MLflow UI")
    loaded_at: datetime
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="what the forward ran in (settings.inference_precision)")


class Prediction(BaseModel):
    label: str
    index: int = Field(description="class index")
    probability: float = Field(ge=0, le=1)


class ClassRef(BaseModel):
    label: str
    index: int = Field(description="class index")


class FaithfulnessCurve(BaseModel):
    deletion: list[float] = Field(
        description="probability of the explained class after removing the most relevant "
        "share `fractions[i]` of the patches/tokens (falls fast for a faithful map)")
    insertion: list[float] = Field(
        description="the same after revealing only them, starting from nothing (rises fast)")
    deletion_auc: float = Field(description="area under `deletion` (lower is better)")
    insertion_auc: float = Field(description="area under `insertion` (higher is better)")


class Faithfulness(BaseModel):
    """Deletion and insertion curves (10 steps) of each returned map and of a random order.

    Images: a removed patch is filled with the image's mean colour; texts: a removed token is
    masked out of attention. All perturbed inputs run in one batched pass."""

    target: ClassRef = Field(description="the class whose probability the curves follow")
    fractions: list[float] = Field(description="share of patches/tokens removed or revealed")
    removal: Literal["mean_colour", "attention_mask"]
    maps: dict[str, FaithfulnessCurve] = Field(
        description="per map (rollout, relevance if asked for, ngram for a text model with an "
        "n-gram head) and `random`, the reference")
    deletion_ratio: dict[str, float] = Field(
        description="each map's deletion AUC / random's: below 1 beats chance, lower is better")
    most_faithful: str = Field(
        description="the map with the lowest deletion AUC, or `random` if none beats chance")


class AttentionEncoding(StrEnum):
    """How the attention arrays (``rollout``, ``layers``, ``heads``, ``relevance``) are written.

    ``json``: nested lists of floats. ``f16-base64``: each array is one
    :class:`EncodedArray`, IEEE half floats (little-endian, row-major) in base64: ~7x smaller
    than the lists (~3 significant digits, plenty for a map that sums to 1), no float
    formatting on either side. Decode with
    ``np.frombuffer(base64.b64decode(a["data"]), "<f2").reshape(a["shape"])``.
    """

    json = "json"
    f16_base64 = "f16-base64"


class EncodedArray(BaseModel):
    """One attention array with ``encoding=f16-base64``."""

    dtype: Literal["float16"] = "float16"
    shape: list[int] = Field(description="e.g. [8, 8] for a rollout grid, [L, H, 8, 8] heads")
    data: str = Field(description="base64 of the little-endian float16 values, row-major")


# --- images ------------------------------------------------------------------------------------


class ImageAttention(BaseModel):
    """Maps of the [CLS] token over the patch grid (rows x cols, row-major, top-left first).

    Every map is the [CLS] row without the [CLS] column, renormalised to sum to 1.
    """

    grid: tuple[int, int] = Field(description="patch grid (rows, cols), e.g. [8, 8]")
    rollout: list[list[float]] | EncodedArray = Field(description="attention rollout, shape "
                                                      "grid")
    layers: list[list[list[float]]] | EncodedArray = Field(
        description="per layer, heads averaged: (L, *grid)")
    heads: list[list[list[list[float]]]] | EncodedArray | None = Field(
        None, description="per layer per head (L, H, *grid); only with attention=heads"
    )
    relevance: list[list[float]] | EncodedArray | None = Field(
        None, description="gradient-weighted relevance for `target`, shape grid; only with "
        "attention=relevance")
    target: ClassRef | None = Field(None, description="the class relevance explains")


class ImageResult(BaseModel):
    filename: str | None = Field(None, description="multipart file name, if any")
    width: int = Field(description="width of the uploaded image")
    height: int = Field(description="height of the uploaded image")
    predictions: list[Prediction] = Field(description="top_k classes, most probable first")
    attention: ImageAttention | None = None
    overlay_png: str | None = Field(
        None, description="base64 PNG of the relevance (if asked for, else the rollout) heatmap "
        "over the input (overlay=true)"
    )
    faithfulness: Faithfulness | None = Field(None, description="only with faithfulness=true")


class ImagePredictResponse(BaseModel):
    model: ModelInfo
    results: list[ImageResult] = Field(description="one per input image, in input order")


# --- text --------------------------------------------------------------------------------------


class TextPredictRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"text": "A moving, beautifully shot film.", "top_k": 2}]
        },
    )

    text: str | list[str] = Field(description="one text or a list of texts (one result each)")
    model: str | None = Field(
        None, min_length=1, max_length=200, description="served model name (default: settings)"
    )
    # strict: JSON `true` is no count and `1` or "yes" no flag (lax mode would take them)
    top_k: int = Field(2, ge=1, le=1000, strict=True)
    attention: AttentionKind | list[AttentionKind] = Field(
        AttentionKind.rollout, description="one kind or several, e.g. [\"heads\", \"relevance\"]")
    target: Annotated[str, Field(max_length=200)] | StrictInt | None = Field(
        None, description="class label or index to explain (relevance, faithfulness); default: "
        "the predicted class")
    faithfulness: bool = Field(False, strict=True,
                               description="also return deletion/insertion curves")
    encoding: AttentionEncoding = Field(
        AttentionEncoding.json, description="attention arrays as JSON lists or f16-base64")

    @field_validator("text")
    @classmethod
    def _not_empty(cls, v: str | list[str]) -> str | list[str]:
        texts = [v] if isinstance(v, str) else v
        if not texts:
            raise ValueError("at least one text is required")
        for i, t in enumerate(texts):
            if not t.strip():
                raise ValueError(f"text {i} is empty")
            problem = text_problem(t)  # a JSON "\ud800" escape is no text
            if problem:
                raise ValueError(f"text {i} {problem}")
        return v

    @property
    def texts(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)


class TextAttention(BaseModel):
    """Maps of the [CLS] token over the text's tokens (aligned with ``tokens``; [CLS] and
    padding excluded); every attention map sums to 1 (``ngram`` is a signed share of a logit).
    A model whose Transformer reads a head+tail crop of the tokens (``student_len``) has maps
    over the crop, 0 elsewhere; its n-gram head reads every token."""

    rollout: list[float] | EncodedArray
    layers: list[list[float]] | EncodedArray = Field(
        description="per layer, heads averaged: (L, n_tokens)")
    heads: list[list[list[float]]] | EncodedArray | None = Field(
        None, description="per layer per head (L, H, n_tokens); only with attention=heads"
    )
    relevance: list[float] | EncodedArray | None = Field(
        None, description="gradient-weighted relevance for `target`; only with "
        "attention=relevance")
    ngram: list[float] | EncodedArray | None = Field(
        None, description="for a model with an n-gram head (whose logits the served ones "
        "average with the Transformer's): each token's share of `target`'s served logit that "
        "comes from the head, exact and signed (positive: for `target`); each distinct n-gram's "
        "weight counted once and split over its tokens. With the head's bias and [CLS]'s "
        "share, they sum to the head's half of the logit. Not a distribution: it does not sum "
        "to 1. Null for models without the head")
    target: ClassRef | None = Field(None, description="the class relevance and ngram explain")


class TextResult(BaseModel):
    predictions: list[Prediction]
    tokens: list[str] = Field(description="tokenizer pieces the model saw, after [CLS]")
    truncated: bool = Field(description="the text was cut to the model's max_len")
    attention: TextAttention | None = None
    faithfulness: Faithfulness | None = Field(None, description="only with faithfulness=true")


class TextPredictResponse(BaseModel):
    model: ModelInfo
    results: list[TextResult] = Field(description="one per input text, in input order")


# --- models ------------------------------------------------------------------------------------


class InputSpec(BaseModel):
    """What the model expects; the server does this preprocessing itself."""

    type: Literal["image", "text"]
    image_size: int | None = Field(None, description="images are resized to image_size^2 RGB")
    mean: list[float] | None = None
    std: list[float] | None = None
    patch_grid: tuple[int, int] | None = None
    content_types: list[str] | None = None
    max_len: int | None = Field(None, description="texts are truncated to max_len tokens")
    truncation: Literal["head", "head_tail"] | None = Field(
        None, description="what truncation keeps: the first tokens, or the first and the last")
    vocab_size: int | None = None


class ModelEntry(BaseModel):
    name: str
    source: str
    loaded: bool
    task: Literal["image", "text"] | None = None
    version: str | None = None
    alias: str | None = None
    run_id: str | None = None
    run_url: str | None = None
    classes: list[str] | None = None
    input: InputSpec | None = None
    architecture: dict | None = Field(None, description="model config from the bundle")
    loaded_at: datetime | None = None
    load_seconds: float | None = None
    precision: Literal["fp32", "bf16"] | None = Field(
        None, description="what the served forward runs in (settings.inference_precision)")
    served_val_acc: float | None = Field(
        None, description="validation accuracy in that precision, as its training run measured "
        "it (null when not measured)")
    relevance: bool | None = Field(
        None, description="whether attention=relevance (and its faithfulness curves) can be "
        "asked of this version; probed when it loads")
    relevance_unavailable: str | None = Field(
        None, description="why not, when relevance is false (such requests answer 422)")
    error: str | None = Field(None, description="last load error, if any")


class ClassMetrics(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    label: str = Field(validation_alias="class")  # per_class.json calls it "class"
    support: int
    precision: float
    recall: float
    f1: float


class ModelCard(BaseModel):
    """What a served version is and how well it does (bundle + its MLflow run)."""

    name: str
    version: str | None
    alias: str | None
    task: Literal["image", "text"]
    run_id: str | None
    run_url: str | None
    run_name: str | None = None
    recipe: str | None = Field(None, description="the recipe it was trained with")
    preset: str | None = Field(None, description="model preset from the registry")
    parameters: int
    val_acc: float | None = Field(None, description="validation accuracy (MLflow's, else the "
                                  "bundle's)")
    val_loss: float | None = None
    precision: Literal["fp32", "bf16"] | None = Field(
        None, description="what the served forward runs in; val_acc is fp32's")
    served_val_acc: float | None = Field(
        None, description="validation accuracy in the served precision (bf16: measured by the "
        "training run on a CPU with native bf16, else null)")
    relevance: bool | None = Field(
        None, description="whether attention=relevance (and its faithfulness curves) can be "
        "asked of this version; probed when it loads")
    relevance_unavailable: str | None = Field(
        None, description="why not, when relevance is false (such requests answer 422)")
    step: int | None = Field(None, description="optimiser steps trained")
    ema: bool | None = None
    budget_minutes: float | None = None
    training_s: float | None = Field(None, description="wall-clock of the training run")
    classes: list[str]
    per_class: list[ClassMetrics] | None = Field(None, description="at the last evaluation")
    confusion: list[list[int]] | None = Field(
        None, description="rows = true class, columns = predicted")
    mlflow_error: str | None = Field(None, description="why the run's part is missing")


class ModelsResponse(BaseModel):
    models: list[ModelEntry]


class ReloadResponse(BaseModel):
    name: str
    reloaded: bool = Field(description="a new version was loaded and swapped in")
    previous_version: str | None
    model: ModelEntry


# --- health ------------------------------------------------------------------------------------


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    pid: int = Field(description="the worker process that answered")
    leader: bool = Field(description="whether it runs the job scheduler and the registry poll "
                         "(one process per home)")


class ReadyResponse(BaseModel):
    status: Literal["ready", "not ready"]
    loaded: dict[str, str | None] = Field(description="loaded model -> version")
    missing: list[str] = Field(description="configured models not loaded yet")
    pid: int = Field(description="the worker process that answered (`serve --workers N`)")
