"""The parts of a recipe: one strict pydantic model per section (model, data, optim, augment,
init, mae, mlm), each checking its own fields; :class:`training.recipe_schema.Recipe` puts them
together and checks how they fit.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from vit_service.models import get_config, list_models
from vit_service.value_types import type_problem

SEED_MAX = 2**32 - 1  # numpy's seed range; torch takes less than 2**64
WRONG_TYPE = "wrong_type"  # the error type of a value refused by Strict._no_coercion
COUNT_MAX = 10**9  # examples or steps: more than any data set here
RUN_ID = re.compile(r"[0-9a-f]{32}")  # an MLflow run id (fullmatch)


class Strict(BaseModel):
    # allow_inf_nan: an lr or a rate of inf / nan is no setting ("1e999" in a JSON job body
    # parses to inf)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `epochs: true` as 1 and `hflip: 1` as true: in a job body
        # each is a mistake, refused here (strings were read by YAML rules before: "3" is 3)
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (problem := type_problem(value, field.annotation)):
            raise PydanticCustomError(WRONG_TYPE, problem)
        return value


class ModelSpec(Strict):
    name: str = Field(description="preset name, see `vit_service.models.list_models()`")
    pos_encoding: Literal["learned", "sinusoidal", "none"] = Field(
        description="positional encoding; explicit in every recipe (an ablation knob)"
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="other preset fields to replace (depth, drop_rate...)"
    )

    @model_validator(mode="after")
    def _check_preset(self) -> ModelSpec:
        if self.name not in list_models():
            raise ValueError(f"unknown model {self.name!r}; available: {', '.join(list_models())}")
        fixed = {"pos_encoding", "num_classes", "vocab_size", "pad_id"} & set(self.overrides)
        if fixed:
            raise ValueError(f"model.overrides may not set {sorted(fixed)} (set by recipe/data)")
        try:
            get_config(self.name, pos_encoding=self.pos_encoding, **self.overrides)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return self


BUILTIN_DATASETS = ("cifar10", "imagefolder", "imdb")
DATASET_ID = r"^[0-9a-f]{16}$"  # an uploaded data set (POST /v1/datasets)
REGISTERED_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # an MLflow model name, no path
RESERVED_NAMES = ("cifar10-vit", "imdb-sentiment", "cifar10-mae", "imdb-mlm")
# data.pseudo_labels values that are not a bundle path: teachers the run itself fits first
TEACHER = "teacher"  # this recipe on the labelled part (training/pseudo_labels.py)
NGRAM = "ngram"  # NB-LR on the labelled part (training/ngram_teacher.py)


class DataSpec(Strict):
    dataset: Literal["cifar10", "imagefolder", "imdb"] | Annotated[
        str, Field(pattern=DATASET_ID)] | None = Field(
        description="cifar10, imagefolder (data.path), imdb, or the id of an uploaded data set "
        "(its classes, and for texts its vocabulary, come from the data); null in a generic "
        "recipe: given at run time (--set data.dataset=<id>)")
    path: str | None = Field(
        None, description="imagefolder: the tree (or a tar of it) - `<class>/<image>` folders"
    )
    val_size: int = Field(ge=1, le=COUNT_MAX,
                          description="held-out examples carved (stratified) from train")
    split_seed: int = Field(0, ge=0, le=SEED_MAX,
                            description="seed of the train/val split (keep fixed to compare)")
    val_fraction: float | None = Field(
        None, gt=0, lt=1, description="the share of the rows held out for validation "
        "(instead of val_size; an uploaded image set's own val/ split takes precedence)")
    subset: int | None = Field(None, ge=1, le=COUNT_MAX,
                               description="train on N (stratified) train rows")
    image_size: int = Field(32, ge=8, le=1024)
    vocab_size: int | None = Field(None, ge=64, description="text: subword vocabulary size")
    max_len: int | None = Field(None, ge=8, description="text: tokens per review incl. [CLS]")
    length_buckets: bool = Field(True, description="text: batch reviews of similar length")
    truncation: Literal["head", "head_tail"] = Field(
        "head", description="text: keep the first max_len tokens, or the first quarter and the "
        "last three quarters of them (saved with the model: serving truncates the same way)")
    include_unsup: bool = Field(
        False, description="imdb + objective mlm: also pretrain on the 50,000 unlabelled "
        "reviews; + objective classify with pseudo_labels: train on those a teacher labels")
    pseudo_labels: str | list[str] | None = Field(
        None, description="imdb + classify + include_unsup: a teacher text bundle (folder), or "
        "several (their probabilities averaged), whose confident predictions label the "
        "unlabelled reviews (self-training); 'teacher': the run trains its teachers first; "
        "'ngram': a naive-Bayes n-gram logistic regression fitted on the labelled part")
    pseudo_teachers: int = Field(
        1, ge=1, le=5, description="with pseudo_labels 'teacher': how many teachers the run "
        "trains (seeds seed, seed+1, ...); their mean labels the reviews, more of them right")
    pseudo_min_confidence: float = Field(
        0.9, ge=0.5, le=1.0, description="the teacher's least top-class probability for a "
        "review to join the train part")
    pseudo_soft: bool = Field(
        False, description="with pseudo_labels: the student learns the teachers' mean "
        "probabilities on those reviews (distillation), not their top class")

    @model_validator(mode="after")
    def _check_text_fields(self) -> DataSpec:
        if self.dataset == "imdb" and (self.vocab_size is None or self.max_len is None):
            raise ValueError("imdb needs data.vocab_size and data.max_len")
        if (self.dataset == "imagefolder") != (self.path is not None):
            raise ValueError("data.path is required for (and only for) dataset imagefolder")
        if self.include_unsup and self.dataset != "imdb":
            raise ValueError("data.include_unsup is for dataset imdb")
        if self.pseudo_labels is not None and not self.include_unsup:
            raise ValueError("data.pseudo_labels labels the unlabelled reviews: it needs "
                             "data.include_unsup")
        if self.pseudo_teachers > 1 and self.pseudo_labels != TEACHER:
            raise ValueError("data.pseudo_teachers is how many teachers a run trains: it needs "
                             "data.pseudo_labels: teacher")
        if self.pseudo_soft and self.pseudo_labels is None:
            raise ValueError("data.pseudo_soft distils the teachers' probabilities: it needs "
                             "data.pseudo_labels")
        if isinstance(self.pseudo_labels, list) and not self.pseudo_labels:
            raise ValueError("data.pseudo_labels: give at least one teacher bundle")
        return self


Beta = Annotated[float, Field(ge=0, lt=1)]
_LION_BETAS = (0.9, 0.99)  # the paper's; AdamW's 0.999 averages ~10x more updates into m


class OptimSpec(Strict):
    optimizer: Literal["adamw", "lion"] = Field(
        "adamw", description="adamw, or lion (sign updates, one state tensor; wants a 3-10x "
        "smaller lr and a 3-10x larger weight_decay than AdamW; eps unused; betas (0.9, 0.99) "
        "unless set, and a recipe's own betas are kept)")
    lr: float = Field(gt=0, le=10, description="peak learning rate (for the global batch)")
    min_lr: float = Field(0.0, ge=0, description="the lr of the last update (decay floor)")
    schedule: Literal["cosine", "linear"] = Field(
        "cosine", description="decay after warm-up, to min_lr at the last update; linear decay "
        "to zero is best under a fixed time budget (Li et al. 2020)")
    weight_decay: float = Field(0.05, ge=0)
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="each in [0, 1); without "
                                     "a value, lion's default is (0.9, 0.99)")
    eps: float = Field(1e-8, gt=0)
    warmup_epochs: float | None = Field(None, ge=0)
    warmup_steps: int | None = Field(None, ge=0, le=COUNT_MAX)
    warmup_fraction: float | None = Field(
        None, ge=0, lt=1, description="warm-up as a share of all updates (with budget_minutes: "
        "of the planned ones)")
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    grad_clip: float | None = Field(None, gt=0, description="max global grad norm; null = off")
    ema_decay: float | None = Field(None, gt=0, lt=1, description="EMA of weights; null = off")
    layer_decay: float | None = Field(
        None, gt=0, le=1, description="layer-wise lr decay: block i of L gets lr * "
        "decay^(L - i), embeddings decay^(L + 1), head/norm lr; null = off"
    )

    @model_validator(mode="before")
    @classmethod
    def _lion_betas(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("optimizer") == "lion" and "betas" not in data:
            return {**data, "betas": _LION_BETAS}
        return data

    @model_validator(mode="after")
    def _one_warmup(self) -> OptimSpec:
        if sum(w is not None for w in (self.warmup_epochs, self.warmup_steps,
                                       self.warmup_fraction)) > 1:
            raise ValueError("set one of warmup_epochs, warmup_steps, warmup_fraction")
        return self

    @model_validator(mode="after")
    def _decay_below_one(self) -> OptimSpec:
        if self.lr * self.weight_decay >= 1:  # decoupled decay: p *= 1 - lr * wd per update
            raise ValueError(f"optim.lr * optim.weight_decay must be < 1, got {self.lr} * "
                             f"{self.weight_decay}: the decay would zero or flip the weights")
        return self


class AugmentSpec(Strict):
    crop_padding: int = Field(0, ge=0, le=128,
                              description="random crop after zero padding; 0 = off")
    hflip: bool = False
    cutmix_prob: float = Field(0.0, ge=0, le=1, description="per-batch probability of CutMix")
    cutmix_alpha: float = Field(1.0, gt=0)
    mixup_alpha: float = Field(0.0, ge=0, description="Mixup on batches without CutMix; 0 = off")
    randaugment_ops: int = Field(0, ge=0, le=16, description="RandAugment ops per image; 0 = off")
    randaugment_magnitude: int = Field(9, ge=0, le=30)
    token_dropout: float = Field(
        0.0, ge=0, lt=1, description="text, training only: each real token after [CLS] is "
        "hidden from attention and pooling with this probability (word dropout)")
    resolution_schedule: list[tuple[float, int]] = Field(
        default_factory=list, description="images, training only: [[until, size], ...]: the "
        "steps before fraction `until` of the run see `size`-px images (downsampled after "
        "augmentation; a smaller patch grid), full size after (progressive resizing); "
        "`until` increasing in (0, 1)")

    @model_validator(mode="after")
    def _check_resolution_schedule(self) -> AugmentSpec:
        ends = [u for u, _ in self.resolution_schedule]
        if any(not 0 < u < 1 for u in ends) or ends != sorted(set(ends)):
            raise ValueError("augment.resolution_schedule: `until` fractions must increase "
                             f"strictly inside (0, 1), got {ends}")
        return self


class InitSpec(Strict):
    """Where the weights come from before training (all null: from scratch)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              allow_inf_nan=False)

    from_: str | None = Field(
        None, alias="from", description="runs:/<run id>, a bare run id, models:/name@alias, "
        "models:/name/<version>, a checkpoint file (.pt) or a bundle folder/its weights.pt"
    )
    timm: str | None = Field(None, description="timm model name whose weights to load (ViT)")
    timm_file: str | None = Field(
        None, description="local weights file for init.timm (offline); null = the hub"
    )
    whiten_patches: bool = Field(
        False, description="from scratch, ViT: the first conv's filters = PCA whitening of "
        "training patches")
    mimetic: bool = Field(
        False, description="from scratch: mimetic attention init (W_q W_k^T ~ I, W_v W_o ~ -I)")

    @model_validator(mode="after")
    def _check(self) -> InitSpec:
        if self.from_ is not None and self.timm is not None:
            raise ValueError("set init.from or init.timm, not both")
        if self.timm_file is not None and self.timm is None:
            raise ValueError("init.timm_file needs init.timm (the model name)")
        if self.from_ is not None:
            check_init_source(self.from_)
        if self.enabled and (self.whiten_patches or self.mimetic):
            raise ValueError("init.whiten_patches and init.mimetic are for training from "
                             "scratch, not with init.from / init.timm")
        return self

    @property
    def enabled(self) -> bool:
        return self.from_ is not None or self.timm is not None


def check_init_source(spec: str) -> None:
    """Syntax of ``init.from`` (existence is checked when the run starts)."""
    s = spec.strip()
    if not s:
        raise ValueError("init.from is empty")
    if s.startswith("models:/"):
        body = s.removeprefix("models:/")
        name, sep, rest = body.partition("@") if "@" in body else body.partition("/")
        if not name or not sep or not rest or "/" in rest:
            raise ValueError(f"init.from {s!r}: expected models:/<name>@<alias> or "
                             "models:/<name>/<version>")
    elif s.startswith("runs:/"):
        run, _, path = s.removeprefix("runs:/").partition("/")
        # a run id is 32 hex digits; the artifact path stays inside the run ("..": no)
        if not RUN_ID.fullmatch(run) or ".." in path.split("/"):
            raise ValueError(f"init.from {s!r}: expected runs:/<32-hex run id>[/model]")
    elif "://" in s:
        raise ValueError(f"init.from {s!r}: only runs:/, models:/, run ids and local paths")


class MAESpec(Strict):
    """Masked-autoencoder pretraining (objective ``mae``)."""

    mask_ratio: float = Field(0.75, gt=0, lt=1, description="fraction of patches hidden")
    decoder_dim: int = Field(128, ge=8, description="decoder width (divisible by 4 and heads)")
    decoder_depth: int = Field(2, ge=1)
    decoder_heads: int = Field(4, ge=1)
    norm_pix_loss: bool = Field(True, description="per-patch normalised pixel targets")
    samples: int = Field(8, ge=0, description="val images in the reconstruction picture")

    @model_validator(mode="after")
    def _check(self) -> MAESpec:
        if self.decoder_dim % 4 or self.decoder_dim % self.decoder_heads:
            raise ValueError("mae.decoder_dim must divide by 4 and by mae.decoder_heads")
        return self


class MLMSpec(Strict):
    """Masked-language-model pretraining (objective ``mlm``)."""

    mask_prob: float = Field(0.15, gt=0, lt=1, description="fraction of real tokens predicted")
    replace_mask: float = Field(0.8, ge=0, le=1, description="of those: replaced by [MASK]")
    replace_random: float = Field(0.1, ge=0, le=1, description="of those: a random token")

    @model_validator(mode="after")
    def _check(self) -> MLMSpec:
        if self.replace_mask + self.replace_random > 1:
            raise ValueError("mlm.replace_mask + mlm.replace_random must be <= 1")
        return self
