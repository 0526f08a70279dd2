"""A model bundle: everything needed to run a trained model, in one folder.

::

    weights.pt       state_dict only (loaded with torch.load(weights_only=True))
    meta.json        task, model config, class names, preprocessing, provenance
    tokenizer.json   text models only

Training writes it, MLflow stores it as the registered model's artifacts, serving loads it. No
pickled Python objects anywhere, so loading a bundle never executes code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from vit_service.models import build_model_from_dict

log = logging.getLogger(__name__)

WEIGHTS, META, TOKENIZER = "weights.pt", "meta.json", "tokenizer.json"

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class BundleMeta:
    task: Literal["image", "text"]  # what the inputs are
    model_config: dict[str, Any]  # config_to_dict(model.config): rebuilds the architecture
    class_names: list[str]  # index -> label
    # image: {"image_size": 32, "mean": [...], "std": [...]};
    # text: {"max_len": 256, "truncation": "head" | "head_tail"}
    preprocess: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)  # recipe name, metrics, lineage...

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, s: str) -> BundleMeta:
        return cls(**json.loads(s))


@dataclass
class ModelBundle:
    model: nn.Module
    meta: BundleMeta
    tokenizer: Any | None = None  # vit_service.data.tokenizer.TextTokenizer for text models


def save_bundle(
    path: str | Path, model: nn.Module, meta: BundleMeta, tokenizer: Any = None
) -> Path:
    """Write the bundle folder and return its path. It is written beside ``path`` and renamed
    into place, so a reader (a server reloading it) sees the old bundle or the new one, whole,
    never a half-written one."""
    path = Path(path)
    if tokenizer is None and meta.task == "text":
        raise ValueError("a text bundle needs its tokenizer")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        torch.save(state, tmp / WEIGHTS)
        (tmp / META).write_text(meta.to_json())
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_bundle(path: str | Path, device: str | torch.device = "cpu") -> ModelBundle:
    """Rebuild the model from ``meta.json``, load weights safely, put it in eval mode."""
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path} is not a model bundle (no {META})")
    meta = BundleMeta.from_json((path / META).read_text())
    model = build_model_from_dict(meta.model_config)
    state = torch.load(path / WEIGHTS, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.to(device).eval()
    tokenizer = None
    if (path / TOKENIZER).is_file():
        from vit_service.data.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.load(path / TOKENIZER)
    log.info("loaded %s bundle from %s", meta.task, path)
    return ModelBundle(model=model, meta=meta, tokenizer=tokenizer)
