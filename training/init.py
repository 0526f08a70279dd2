"""Initial weights of a run (``recipe.init``): fine-tuning from a pretrained encoder.

Sources of ``init.from`` (resolved by :func:`resolve_init`):

* ``runs:/<run id>`` (or ``runs:/<run id>/model``, or a bare 32-hex run id): the bundle the run
  logged as its MLflow model;
* ``models:/<name>@<alias>`` / ``models:/<name>/<version>`` (``@latest`` = the newest version):
  a registered model's bundle;
* a checkpoint file (``<run dir>/checkpoints/last.pt``; its EMA weights when it has them, like
  the bundle);
* a bundle folder (``<run dir>/bundle``) or its ``weights.pt``.

Each gives the *encoder*: the weights of an MAE/MLM encoder, or of a classifier without its
``head.*``. :func:`load_encoder` copies them into the new model (every non-head tensor must
load; a ViT's positional table and patch kernel are resampled when the grid or patch size
differ) and leaves the new model's freshly initialised head, sized for the new classes. Text
sources also carry their tokenizer: a fine-tuned text model must use the pretraining vocabulary.

``init.timm`` (+ ``init.timm_file`` offline) builds the ViT from timm's weights instead
(:func:`build_timm_model`). What was loaded is recorded as a :class:`Lineage` (MLflow tags on
the run, the bundle's ``meta.json``, the checkpoint).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from training import checkpoint as ckpt_io
from training.recipe_parts import RUN_ID
from training.recipes import Recipe
from vit_service.bundle import META, TOKENIZER, WEIGHTS, BundleMeta
from vit_service.data.tokenizer import TextTokenizer
from vit_service.models import ViT, get_config

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("head.", "fc_norm.")


class InitError(ValueError):
    """``init.from`` could not be used: missing source, or weights that do not fit the model."""


@dataclass
class Lineage:
    """Where a run's initial weights came from."""

    init: str = "scratch"  # scratch | run | model | checkpoint | bundle | timm
    source: str = ""  # init.from / init.timm as written in the recipe
    parent_run_id: str | None = None  # the MLflow run that produced the weights
    parent_model: str | None = None  # "<registered name>/<version>" for models:/ sources
    parent_recipe: str | None = None  # name of the parent run's recipe
    parent_objective: str | None = None  # mae | mlm | classify
    timm_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Lineage:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in (d or {}).items() if k in known})

    def tags(self) -> dict[str, str]:
        """MLflow tags of the run (``lineage.*`` kept for runs logged before fine-tuning)."""
        return {
            "lineage.init": self.init,
            "lineage.parent_run_id": self.parent_run_id or "",
            "vit_service.init_kind": self.init,
            "vit_service.init_source": self.source,
            "vit_service.parent_run_id": self.parent_run_id or "",
            "vit_service.parent_model": self.parent_model or "",
            "vit_service.parent_recipe": self.parent_recipe or "",
            "vit_service.parent_objective": self.parent_objective or "",
        }


@dataclass
class InitSource:
    """A pretrained encoder, ready to load."""

    state: dict[str, Tensor]  # encoder weights, keys as in ViT / TextTransformer, no head
    model_config: dict[str, Any] | None  # the source encoder's config (config_to_dict form)
    lineage: Lineage
    tokenizer: TextTokenizer | None = None  # text sources: the pretraining vocabulary
    parent_recipe: dict[str, Any] | None = field(default=None, repr=False)


# ----------------------------------------------------------------------------- resolving


def resolve_init(spec: str, tracking_uri: str | None = None, settings: Any = None
                 ) -> InitSource:
    """``init.from`` -> :class:`InitSource` (downloads MLflow artifacts to a temp folder)."""
    spec = spec.strip()
    path = Path(spec).expanduser()
    if spec.startswith("models:/"):
        return _from_registry(spec, tracking_uri, settings)
    if spec.startswith("runs:/") or (RUN_ID.fullmatch(spec) and not path.exists()):
        return _from_run(spec, tracking_uri, settings)
    if path.is_dir():
        if (path / META).is_file():
            return _from_bundle_dir(path, spec, "bundle")
        raise InitError(f"init.from {spec!r}: a folder but not a model bundle (no {META}); "
                        f"give the bundle folder, a checkpoint file, runs:/ or models:/")
    if path.is_file():
        if path.name == WEIGHTS and (path.parent / META).is_file():
            return _from_bundle_dir(path.parent, spec, "bundle")
        return _from_checkpoint(path, spec)
    raise InitError(f"init.from {spec!r}: no such file or folder (and not a runs:/ or "
                    f"models:/ URI)")


def _from_registry(spec: str, tracking_uri: str | None, settings: Any) -> InitSource:
    from mlflow.exceptions import MlflowException

    from vit_service import tracking

    tracking.configure(tracking_uri, settings)
    try:
        ref = tracking.resolve_model(spec)
    except MlflowException as e:
        raise InitError(f"init.from {spec!r}: {e.message}") from None
    with tempfile.TemporaryDirectory(prefix="vit-service-init-") as tmp:
        src = _from_bundle_dir(tracking.download_bundle(ref, tmp), spec, "model")
    src.lineage.parent_run_id = ref.run_id or src.lineage.parent_run_id
    src.lineage.parent_model = f"{ref.name}/{ref.version}"
    return src


def _from_run(spec: str, tracking_uri: str | None, settings: Any) -> InitSource:
    from mlflow.exceptions import MlflowException

    from vit_service import tracking

    tracking.configure(tracking_uri, settings)
    body = spec.removeprefix("runs:/")
    run_id, _, artifact = body.partition("/")
    try:
        with tempfile.TemporaryDirectory(prefix="vit-service-init-") as tmp:
            src = _from_bundle_dir(
                tracking.download_bundle_uri(f"runs:/{run_id}/{artifact or 'model'}", tmp),
                spec, "run")
    except (MlflowException, OSError) as e:
        raise InitError(f"init.from {spec!r}: cannot fetch the run's model bundle: {e}") from None
    src.lineage.parent_run_id = run_id
    return src


def _strip_head(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIXES)}


def _from_bundle_dir(path: Path, spec: str, kind: str) -> InitSource:
    meta = BundleMeta.from_json((path / META).read_text())
    state = torch.load(path / WEIGHTS, map_location="cpu", weights_only=True)
    extra = meta.extra or {}
    tok = TextTokenizer.load(path / TOKENIZER) if (path / TOKENIZER).is_file() else None
    recipe = extra.get("recipe") or None
    lineage = Lineage(init=kind, source=spec, parent_run_id=extra.get("run_id"),
                      parent_recipe=(recipe or {}).get("name"),
                      parent_objective=extra.get("objective", "classify"))
    return InitSource(_strip_head(state), meta.model_config, lineage, tok, recipe)


def _from_checkpoint(path: Path, spec: str) -> InitSource:
    try:
        ck = ckpt_io.load_checkpoint(path)
    except Exception as e:  # not a torch file, or pickled objects weights_only refuses
        raise InitError(f"init.from {spec!r}: not a readable checkpoint ({e})") from None
    if not isinstance(ck, dict) or not isinstance(ck.get("model"), dict):
        raise InitError(f"init.from {spec!r}: not a vit-service checkpoint (no 'model' state)")
    ema = ck.get("ema")
    state: dict[str, Tensor] = ema["module"] if isinstance(ema, dict) else ck["model"]
    if any(k.startswith("encoder.") for k in state):  # an MAE / MLM model: keep the encoder
        state = {k.removeprefix("encoder."): v for k, v in state.items()
                 if k.startswith("encoder.")}
    recipe = ck.get("recipe") or None
    tok = TextTokenizer.from_str(ck["tokenizer"]) if ck.get("tokenizer") else None
    lineage = Lineage(init="checkpoint", source=spec, parent_run_id=ck.get("mlflow_run_id"),
                      parent_recipe=(recipe or {}).get("name"),
                      parent_objective=ck.get("objective")
                      or (recipe or {}).get("objective", "classify"))
    return InitSource(_strip_head(state), ck.get("model_config"), lineage, tok, recipe)


# ----------------------------------------------------------------------------- loading


def encoder_of(model: nn.Module) -> nn.Module:
    """The ViT / TextTransformer inside an MAE or MLM model (the model itself otherwise)."""
    enc = getattr(model, "encoder", None)
    return enc if isinstance(enc, nn.Module) else model


def _arch_summary(cfg: dict[str, Any] | None) -> str:
    if not cfg:
        return "unknown"
    keys = ("arch", "embed_dim", "depth", "num_heads", "patch_size", "img_size", "vocab_size",
            "max_len", "pos_encoding")
    return ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


def load_encoder(model: nn.Module, src: InitSource) -> int:
    """Copy ``src``'s encoder weights into ``model`` (a ViT or TextTransformer), keeping the
    model's own head. Returns the number of tensors loaded; raises :class:`InitError` if any
    non-head tensor is missing or does not fit."""
    from vit_service.models.pretrained import adapt_timm_state_dict

    cfg = model.config
    state = dict(src.state)
    target = model.state_dict()
    dropped_pos = False
    if isinstance(model, ViT):
        try:
            state = adapt_timm_state_dict(state, cfg)  # resample grid / patch; our keys = timm's
        except KeyError as e:
            raise InitError(f"init: the source is not a ViT encoder (missing {e})") from None
        dropped_pos = cfg.pos_encoding != "learned"
    else:  # text
        pe = state.get("pos_embed")
        if cfg.pos_encoding != "learned":
            state.pop("pos_embed", None)  # fixed table: the model's own (any max_len)
            dropped_pos = True
        elif pe is not None and pe.shape[1] != target["pos_embed"].shape[1]:
            if pe.shape[1] < target["pos_embed"].shape[1]:
                raise InitError(f"init: source positions cover {pe.shape[1]} tokens, the model "
                                f"needs {target['pos_embed'].shape[1]} (lower data.max_len)")
            state["pos_embed"] = pe[:, : target["pos_embed"].shape[1]]
    if dropped_pos and src.model_config and src.model_config.get("pos_encoding") == "learned":
        log.warning("init: the source's learned positions are not used (pos_encoding=%s)",
                    cfg.pos_encoding)
    allowed_missing = {k for k in target if k.startswith(HEAD_PREFIXES)}
    if dropped_pos:
        allowed_missing.add("pos_embed")
    missing = sorted(set(target) - set(state) - allowed_missing)
    unexpected = sorted(set(state) - set(target))
    wrong = sorted(f"{k}: source {tuple(v.shape)} vs model {tuple(target[k].shape)}"
                   for k, v in state.items() if k in target and v.shape != target[k].shape)
    if missing or unexpected or wrong:
        problems = ([f"missing {missing[:6]}"] if missing else []) + (
            [f"unexpected {unexpected[:6]}"] if unexpected else []) + wrong[:6]
        from vit_service.models import config_to_dict

        raise InitError(
            "init: the pretrained encoder does not fit the recipe's model ("
            + "; ".join(problems) + f"). Source: {_arch_summary(src.model_config)}; model: "
            + _arch_summary(config_to_dict(cfg)) + ". Set model.name / model.overrides to the "
            "pretrained architecture.")
    model.load_state_dict(state, strict=False)
    log.info("init: loaded %d encoder tensors from %s (%s); head %s is new", len(state),
             src.lineage.source, src.lineage.init,
             tuple(model.head.weight.shape) if isinstance(model.head, nn.Linear) else "-")
    return len(state)


def check_split(recipe: Recipe, parent_recipe: dict[str, Any] | None) -> None:
    """Warn when the pretraining run carved a different validation split of the same data
    (then it may have trained on some of this run's validation examples)."""
    if not parent_recipe:
        return
    pd = parent_recipe.get("data") or {}
    d = recipe.data
    same_data = pd.get("dataset") == d.dataset and pd.get("path") == d.path
    if same_data and (pd.get("val_size"), pd.get("split_seed", 0)) != (d.val_size, d.split_seed):
        log.warning("init: the pretraining run used data.val_size=%s split_seed=%s, this run "
                    "%s/%s: some validation examples may have been seen in pretraining",
                    pd.get("val_size"), pd.get("split_seed", 0), d.val_size, d.split_seed)


# ----------------------------------------------------------------------------- timm


def build_timm_model(recipe: Recipe, num_classes: int) -> tuple[nn.Module, Lineage]:
    """A ViT with timm ``init.timm``'s width/depth/heads and weights, at the recipe preset's
    image and patch size (positions and patch kernel resampled), its dropout/stochastic-depth
    rates, and a new head of ``num_classes``."""
    from vit_service.models.pretrained import vit_from_timm

    m, init = recipe.model, recipe.init
    assert init.timm is not None
    cfg = get_config(m.name, pos_encoding=m.pos_encoding, **m.overrides)
    try:
        model = vit_from_timm(
            init.timm, img_size=cfg.img_size, patch_size=cfg.patch_size,  # type: ignore[union-attr]
            num_classes=num_classes, file=init.timm_file, pos_encoding=m.pos_encoding,
            drop_rate=cfg.drop_rate, attn_drop_rate=cfg.attn_drop_rate,
            drop_path_rate=cfg.drop_path_rate)
    except (RuntimeError, ValueError) as e:
        raise InitError(f"init.timm {init.timm!r}: {e}") from None
    return model, Lineage(init="timm", source=f"timm:{init.timm}", timm_file=init.timm_file)
