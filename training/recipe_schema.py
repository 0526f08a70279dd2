"""The recipe schema: nested pydantic models, ``extra="forbid"`` everywhere.

A :class:`Recipe` says everything a run needs (objective, model preset and overrides, initial
weights, data, optimiser, augmentation, schedule, device, registration) and checks that its parts
fit together. Reading YAML files and applying ``--set`` overrides is ``training.recipes``.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from training.recipe_parts import (
    BUILTIN_DATASETS,
    REGISTERED_NAME,
    RESERVED_NAMES,
    SEED_MAX,
    AugmentSpec,
    DataSpec,
    InitSpec,
    MAESpec,
    MLMSpec,
    ModelSpec,
    OptimSpec,
    Strict,
)
from vit_service.models import get_config, list_models

PRETRAIN_REGISTRY = {"mae": "cifar10-mae", "mlm": "imdb-mlm"}


class Recipe(Strict):
    name: str = Field(description="recipe name (file stem)")
    description: str = ""
    objective: Literal["classify", "mae", "mlm"] = Field(
        "classify", description="classify (labels), mae (masked images), mlm (masked tokens)"
    )
    model: ModelSpec
    init: InitSpec = Field(default_factory=InitSpec)
    freeze_encoder: bool = Field(False, description="linear probe: only the head trains")
    mae: MAESpec | None = Field(None, description="objective mae only")
    mlm: MLMSpec | None = Field(None, description="objective mlm only")
    data: DataSpec
    optim: OptimSpec
    augment: AugmentSpec = Field(default_factory=AugmentSpec)
    epochs: int = Field(ge=1)
    batch_size: int = Field(ge=1, description="global batch (split across DDP ranks)")
    eval_batch_size: int = Field(512, ge=1)
    seed: int = Field(0, ge=0, le=SEED_MAX, description="torch, numpy and data order seed")
    device: Literal["cpu", "cuda", "auto"] = "auto"
    amp: bool = Field(True, description="bf16 autocast on CUDA (training and evaluation)")
    cpu_bf16: bool = Field(
        False, description="bf16 autocast of the training step on a CPU that computes bf16 in "
        "hardware (AVX-512 BF16 or AMX; elsewhere fp32, logged); validation stays fp32, as "
        "served")
    attention: Literal["auto", "fused", "explicit"] = Field(
        "auto", description="attention path of the training forward: fused "
        "(scaled_dot_product_attention) or explicit (softmax(q k^T) v); auto: explicit for a "
        "bf16 step on the CPU (the CPU flash kernel's bf16 backward is slow), else fused; "
        "evaluation always runs fused")
    compile: bool = Field(False, description="torch.compile the training forward")
    max_steps: int | None = Field(
        None, ge=1, description="stop after N steps; the schedule still spans `epochs`"
    )
    budget_minutes: float | None = Field(
        None, gt=0, le=7 * 24 * 60, description="wall-clock budget of the whole run (start-up, "
        "evaluations and publishing included): the trainer measures its throughput and sizes "
        "the schedule to end on time; `epochs` is then ignored")
    log_every: int = Field(20, ge=1, description="steps between train metric logs")
    attention_samples: int = Field(8, ge=0, description="val examples in the attention sheet")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (CPU)")
    processes: int = Field(
        1, ge=1, le=64, description="CPU: data-parallel training processes the command starts "
        "itself (Gloo DDP, cores / N threads each unless `threads`; batch_size stays the global "
        "batch). For many-core CPU hosts, where one process rarely uses every core; on 2 "
        "cores the ranks wait for each other, so no recipe sets it (docs/training.md, 'One "
        "process per core'). On CUDA use torchrun")
    checkpoint_every: int = Field(
        1, ge=1, description="epochs between checkpoints (also written on stop, signal, end)"
    )
    eval_every: int = Field(
        1, ge=1, description="epochs between validation passes; the last one always runs (in a "
        "budget each pass is training time lost: docs/training.md, 'Ablations')")
    val_precision: Literal["fp32", "served"] = Field(
        "fp32", description="precision of the intermediate validation passes (classifiers): "
        "fp32, or served: as the server answers on this machine (bf16 autocast on the explicit "
        "attention path on a CPU with native bf16, cheaper than an fp32 pass; fp32 elsewhere). "
        "The last pass is always fp32, the served-precision accuracy recorded beside it "
        "(val_acc_bf16; docs/training.md, 'Ablations')")
    register_as: str | None = Field(
        None, pattern=REGISTERED_NAME, description="registered model name: the fixed one of a "
        "built-in data set, any other name for an uploaded one")
    # a folder name under the artifact root too: letters, digits, _ . - only (no ../..)
    experiment: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

    @property
    def uploaded(self) -> bool:
        """Whether ``data.dataset`` is an uploaded data set's id."""
        return self.data.dataset not in BUILTIN_DATASETS

    @property
    def task(self) -> Literal["image", "text"]:
        """The input kind: IMDb's and an uploaded set's under a text model are text."""
        if self.data.dataset == "imdb":
            return "text"
        if self.uploaded and self.model.name not in list_models("vit"):
            return "text"
        return "image"

    @property
    def pretraining(self) -> bool:
        return self.objective != "classify"

    @model_validator(mode="before")
    @classmethod
    def _default_objective_section(cls, data: Any) -> Any:
        """``objective: mae`` without a ``mae:`` table gets the defaults (same for mlm)."""
        if isinstance(data, dict) and data.get("objective") in ("mae", "mlm"):
            key = data["objective"]
            if data.get(key) is None:
                data = {**data, key: {}}
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> Recipe:
        is_vit = self.model.name in list_models("vit")
        if is_vit != (self.task == "image"):
            raise ValueError(f"model {self.model.name!r} does not fit dataset {self.data.dataset}")
        obj = self.objective
        if obj == "mae" and self.task != "image":
            raise ValueError("objective mae needs a ViT and an image dataset")
        if obj == "mlm" and self.data.dataset != "imdb":
            raise ValueError("objective mlm needs a text model and dataset imdb")
        for key in ("mae", "mlm"):
            if getattr(self, key) is not None and obj != key:
                raise ValueError(f"the {key}: section is only for objective {key}")
        if self.data.include_unsup and obj != "mlm" and self.data.pseudo_labels is None:
            raise ValueError("data.include_unsup needs objective mlm, or data.pseudo_labels "
                             "(unsup reviews have no labels)")
        if self.data.pseudo_labels is not None and obj != "classify":
            raise ValueError("data.pseudo_labels is for objective classify")
        if self.pretraining:
            a = self.augment
            if a.cutmix_prob or a.mixup_alpha or self.optim.label_smoothing:
                raise ValueError(f"objective {obj} has no labels: set augment.cutmix_prob, "
                                 "augment.mixup_alpha and optim.label_smoothing to 0")
            if self.freeze_encoder:
                raise ValueError("freeze_encoder is for objective classify (a linear probe)")
            if self.init.timm is not None:
                raise ValueError("init.timm is for objective classify")
        if (crop := self.model.overrides.get("student_len")):  # the Transformer reads a crop
            self._check_student_len(crop)
        if self.init.whiten_patches and not is_vit:
            raise ValueError("init.whiten_patches needs a ViT")
        if self.init.timm is not None and not is_vit:
            raise ValueError("init.timm loads ViT weights: use a ViT model")
        if obj == "mae" and self.mae is not None:
            cfg = get_config(self.model.name, pos_encoding=self.model.pos_encoding,
                             **self.model.overrides)
            n = cfg.num_patches  # type: ignore[union-attr]
            if not 0 < round(n * (1 - self.mae.mask_ratio)) < n:
                raise ValueError(f"mae.mask_ratio {self.mae.mask_ratio} leaves no visible or "
                                 f"no masked patch of {n}")
        if self.augment.resolution_schedule:
            self._check_resolution_schedule()
        if self.uploaded:
            if self.task == "text" and (self.data.vocab_size is None or self.data.max_len is None):
                raise ValueError("a text data set needs data.vocab_size and data.max_len")
            if obj != "classify":
                raise ValueError("an uploaded data set trains classifiers (objective classify)")
            if self.register_as in RESERVED_NAMES:
                raise ValueError(f"register_as {self.register_as!r} is a built-in model's name: "
                                 "choose another for an uploaded data set")
            return self
        if obj == "classify":
            expected = {"cifar10": "cifar10-vit", "imdb": "imdb-sentiment"}.get(
                self.data.dataset)
        else:
            expected = PRETRAIN_REGISTRY[obj] if self.data.dataset != "imagefolder" else None
        if self.register_as not in (None, expected):
            raise ValueError(f"register_as must be {expected!r} or null for objective {obj} "
                             f"on {self.data.dataset}" if expected else
                             f"register_as must be null for objective {obj} on "
                             f"{self.data.dataset} (fine-tune from its run: runs:/<id>)")
        return self

    def _check_student_len(self, crop: Any) -> None:
        """``model.overrides.student_len``: a classifier's Transformer reading the head+tail crop
        of its input; the crop equals the tokenizer's cut only when the input was cut alike."""
        if self.task != "text" or self.objective != "classify":
            raise ValueError("model.overrides.student_len is for text classifiers (objective "
                             "classify): MLM reads whole sequences")
        if self.data.truncation != "head_tail":
            raise ValueError("model.overrides.student_len crops the head and the tail: set "
                             "data.truncation: head_tail")
        if isinstance(crop, int) and self.data.max_len is not None and crop > self.data.max_len:
            raise ValueError(f"model.overrides.student_len {crop} > data.max_len "
                             f"{self.data.max_len}: there would be nothing to crop")

    def _check_resolution_schedule(self) -> None:
        if self.task != "image" or self.objective != "classify" or self.init.timm is not None:
            raise ValueError("augment.resolution_schedule is for image classification with "
                             "this project's ViT (not mae, text or init.timm)")
        cfg = get_config(self.model.name, pos_encoding=self.model.pos_encoding,
                         **self.model.overrides)
        p, full = cfg.patch_size, self.data.image_size  # type: ignore[union-attr]
        for _, size in self.augment.resolution_schedule:
            if not p <= size < full or size % p:
                raise ValueError(f"augment.resolution_schedule size {size}: must be a multiple "
                                 f"of the patch size {p} and below data.image_size {full}")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
