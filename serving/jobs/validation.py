"""What a job request may ask: a known recipe *name* (never a path), overrides checked against
the recipe's schema, every path inside the data or home folders, sizes within the server's
caps (settings ``jobs_max_*``), a model of bounded size."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving.jobs.model import JobError
from training.recipe_parts import NGRAM, RUN_ID, TEACHER
from vit_service.config import Settings
from vit_service.data.tokenizer import text_problem

PATH_KEY_SUFFIXES = ("dir", "file", "path", "root", "uri")
# recipe fields that name a file or folder on the server, whatever their key's suffix says
PATH_KEYS = ("data.path", "data.pseudo_labels", "init.from", "init.timm_file")
ALIASED = {"init.from_": "init.from"}  # a field's python name, which the recipe also takes
# init.from may also name a run or a registered model: not a path then
NOT_A_PATH = ("models:/", "runs:/")


def check_text(where: str, value: Any) -> None:
    """Every string in ``value`` (a request's recipe, name, override keys and values, nested)
    must be writable as UTF-8: a JSON "\\ud800" escape decodes to a lone surrogate that no
    answer, log or file name can carry (a job stored with one failed every later listing)."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem:
            raise JobError(422, f"{where} {problem}")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(f"{where} key", k)
            check_text(f"{where}.{k}" if where != "overrides" else f"override {k!r}", v)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_text(f"{where}[{i}]", v)


def typed_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Each override's one reading. A JSON string for a field that takes only text (a path, a
    data set id, a name) is that text, as sent ("pets #1" is no "pets" and "2024" no number);
    any other string is read by YAML rules as ``--set`` reads it (``"3"`` the count 3,
    ``"[0.9, 0.95]"`` a list). The job caps, stores, shows and validates these values, and its
    trainer gets them exactly (:func:`training.recipes.setting_text`), never read again. 422
    for a text field given no text, and for a string YAML reads as no JSON value (a date)."""
    from training.recipes import is_text_field, parse_override

    out: dict[str, Any] = {}
    for k, v in overrides.items():
        if is_text_field(k):
            if v is not None and not isinstance(v, str):
                raise JobError(422, f"override {k!r}: expected a string or null, got {v!r}")
            out[k] = v
            continue
        out[k] = parse_override(k, v)
        if not _json_value(out[k]):
            raise JobError(422, f"override {k!r}: {v!r} reads (by YAML rules) as a "
                                f"{type(out[k]).__name__}, not a JSON value")
    return out


def _json_value(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)  # JSON has no inf or nan ("1e400", ".nan" by YAML rules)
    if v is None or isinstance(v, bool | int | str):
        return True
    if isinstance(v, list):
        return all(_json_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _json_value(x) for k, x in v.items())
    return False


def validate_recipe(recipe: str, overrides: dict[str, Any]) -> None:
    """Only known recipe *names* (never a path), overrides checked against the recipe schema."""
    from training.recipes import RecipeError, list_recipes, load_recipe

    known = list_recipes()
    if recipe not in known:
        raise JobError(422, f"unknown recipe {recipe!r}; known: {', '.join(known)}")
    try:
        load_recipe(recipe, overrides)
    except RecipeError as e:
        raise JobError(422, str(e)) from e


def resolve_paths(overrides: dict[str, Any], roots: list[Path]) -> dict[str, Any]:
    """Every path the overrides name (the recipe's path fields, and any key that looks like
    one, nested or dotted) must stay inside ``roots`` (the data folder first) once resolved:
    ``~`` is refused (the trainer would expand it), a relative path is the data folder's, and
    symlinks are followed. Returns the overrides with each such path replaced by its
    resolved absolute form, which is what the trainer gets."""
    out = copy.deepcopy(overrides)
    for key, value in _flatten(overrides).items():
        k = key.lower()
        if k not in PATH_KEYS and not k.rsplit(".", 1)[-1].endswith(PATH_KEY_SUFFIXES):
            continue
        if value is None:
            continue
        if k == "data.pseudo_labels" and isinstance(value, list) and value:  # an ensemble
            _set(out, key, [_resolve(f"{key}[{i}]", k, v, roots) for i, v in enumerate(value)])
        else:
            _set(out, key, _resolve(key, k, value, roots))
    return out


def _resolve(key: str, k: str, value: Any, roots: list[Path]) -> str:
    """One path override resolved inside ``roots`` (or kept: a run or model reference)."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise JobError(422, f"override {key!r} must be a path string")
    check_text(f"override {key!r}", value)  # no file system name holds a lone surrogate
    if value.startswith("~"):
        raise JobError(422, f"override {key!r}: ~ is not expanded here; give a path "
                            "relative to the data folder")
    if k == "init.from" and (value.startswith(NOT_A_PATH) or RUN_ID.fullmatch(value)):
        return value
    if k == "data.pseudo_labels" and value in (TEACHER, NGRAM):  # fitted by the run itself
        return value
    if "://" in value:
        raise JobError(422, f"override {key!r}: URLs are not accepted here")
    p = Path(value)
    p = (roots[0] / p if not p.is_absolute() else p).resolve()
    if not any(p == r or r in p.parents for r in roots):
        raise JobError(422, f"override {key!r}: {value!r} is outside the data and home "
                            "folders")
    return str(p)


def check_caps(overrides: dict[str, Any], s: Settings) -> None:
    """Sizes a job may ask for through the API (settings ``jobs_max_*``): 422 past them
    (``nprocs`` is capped by the manager's submit itself)."""
    flat_caps = _flatten(overrides)
    caps = {"epochs": s.jobs_max_epochs, "batch_size": s.jobs_max_batch_size,
            "eval_batch_size": s.jobs_max_batch_size, "threads": s.jobs_max_threads,
            "processes": s.jobs_max_procs}
    for key, cap in caps.items():
        value = flat_caps.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            raise JobError(422, f"override {key!r}: {value} is over this server's limit of "
                                f"{cap}")
    budget = flat_caps.get("budget_minutes")
    if isinstance(budget, (int, float)) and budget > s.jobs_max_budget_minutes:
        raise JobError(422, f"override 'budget_minutes': {budget} is over this server's "
                            f"limit of {s.jobs_max_budget_minutes}")


def check_request(recipe: str, overrides: dict[str, Any], nprocs: int, s: Settings,
                  validate: Callable[[str, dict[str, Any]], None] | None) -> dict[str, Any]:
    """A job's typed ``overrides`` against the settings ``s``: ``nprocs`` and the size caps,
    paths inside the data and home folders (returned resolved), and, given ``validate``, the
    recipe as the trainer will read it (with the real :func:`validate_recipe`, also the
    model's size and the data set). :class:`JobError` 422."""
    if not 1 <= nprocs <= s.jobs_max_procs:
        raise JobError(422, f"nprocs must be between 1 and {s.jobs_max_procs}")
    overrides = resolve_paths(overrides, [s.data_dir.resolve(), s.home.resolve()])
    check_caps(overrides, s)
    if validate is not None:
        from training.recipes import setting_texts

        # checked as the trainer will read them: the --set texts its command line carries
        as_read = setting_texts(overrides)
        validate(recipe, as_read)
        if validate is validate_recipe:  # a real recipe: its model can be counted
            check_model_size(recipe, as_read, s.jobs_max_params)
            check_dataset(recipe, as_read, s)
    return overrides


def check_model_size(recipe: str, overrides: dict[str, Any], max_params: int) -> None:
    """The model the job would build, estimated from its config (nothing is built):
    422 past ``max_params``, whatever combination of overrides got it there."""
    from training.recipes import load_recipe
    from vit_service.models import get_config

    r = load_recipe(recipe, overrides)
    fields: dict[str, Any] = {}
    if r.task == "text":  # the tokenizer's real size is known after training it
        fields = {"vocab_size": r.data.vocab_size or 32_000, "max_len": r.data.max_len or 512}
    try:
        cfg = get_config(r.model.name, pos_encoding=r.model.pos_encoding, num_classes=1000,
                         **fields, **r.model.overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise JobError(422, f"model.overrides: {e}") from e
    n = estimate_parameters(cfg)
    if n > max_params:
        raise JobError(422, f"the model would have {n / 1e6:.0f}M parameters; this server "
                            f"takes at most {max_params / 1e6:.0f}M")


def estimate_parameters(cfg: Any) -> int:
    """An upper-bound estimate of a ViT's or text encoder's parameters from its config alone
    (nothing is built: the point is to refuse a job before it allocates): the blocks, the
    token and position tables, the patch stem and the head."""
    d = int(cfg.embed_dim)
    hidden = int(d * float(getattr(cfg, "mlp_ratio", 4.0)))
    block = 4 * d * d + 2 * d * hidden + 10 * d + hidden  # qkv + proj, MLP, norms, biases
    n = int(cfg.depth) * block
    n += int(getattr(cfg, "vocab_size", 0)) * d + int(getattr(cfg, "max_len", 0)) * d
    buckets, width = int(getattr(cfg, "bigram_buckets", 0)), int(getattr(cfg, "bigram_dim", 0))
    n += buckets * (width or d) + (width * d if width else 0)
    # an n-gram head's weights are buffers, not parameters, but take memory all the same
    n += (int(getattr(cfg, "vocab_size", 0)) + int(getattr(cfg, "ngram_head_buckets", 0))) * 2
    patch = int(getattr(cfg, "patch_size", 0))
    n += int(getattr(cfg, "in_chans", 0)) * patch * patch * d
    if getattr(cfg, "img_size", 0) and patch:
        n += (int(cfg.img_size) // patch) ** 2 * d
    stem = int(getattr(cfg, "stem_width", 0)) if getattr(cfg, "stem", "") == "conv" else 0
    n += 9 * (3 * stem + 2 * stem * stem + 8 * stem * stem) + 4 * stem * d
    # stem_depth - 1 more convs at each of its resolutions (w, 2w and 4w channels),
    # stem_full_depth - 1 at the first where it is given
    depth = int(getattr(cfg, "stem_depth", 1))
    full = getattr(cfg, "stem_full_depth", None)
    n += 9 * 20 * stem * stem * max(0, depth - 1)
    n += 9 * stem * stem * max(0, int(depth if full is None else full) - 1)
    return n + d * int(getattr(cfg, "num_classes", 0))


def _flatten(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"data": {"path": x}}`` -> ``{"data.path": x}`` (dotted keys kept as they are). 422
    for one key given twice (dotted and nested: the checks would see one, the trainer the
    other) and for a field's python name in place of its key (``init.from_``: checked as
    no path)."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if full.lower() in ALIASED:
            raise JobError(422, f"override {full!r}: write {ALIASED[full.lower()]!r}")
        flat = _flatten(value, f"{full}.") if isinstance(value, dict) else {full: value}
        for k, v in flat.items():
            if k in out:
                raise JobError(422, f"override {k!r} is given twice")
            out[k] = v
    return out


def _set(overrides: dict[str, Any], dotted: str, value: Any) -> None:
    """Set the value :func:`_flatten` found at ``dotted``, dotted or nested."""
    if dotted in overrides:
        overrides[dotted] = value
        return
    for k in [k for k in overrides if dotted.startswith(f"{k}.")]:
        if isinstance(overrides[k], dict):
            _set(overrides[k], dotted[len(k) + 1:], value)
            return


def check_dataset(recipe: str, overrides: dict[str, Any], settings: Settings) -> None:
    """A recipe on an uploaded data set: its id is given, known, and of the recipe's kind
    (images for a ViT, texts for a text encoder)."""
    from training.recipes import load_recipe
    from vit_service.data.datasets import DatasetStore

    r = load_recipe(recipe, overrides)
    if not r.uploaded:
        return
    if r.data.dataset is None:
        raise JobError(422, f"recipe {recipe} trains on an uploaded data set: give its id "
                            "as data.dataset (POST /v1/datasets answers it)")
    try:
        info = DatasetStore(Path(settings.home) / "datasets").get(r.data.dataset)
    except KeyError:
        raise JobError(422, f"unknown data set {r.data.dataset!r}") from None
    if info.kind != r.task:
        raise JobError(422, f"data set {info.id} holds {info.kind}s: recipe {recipe} trains "
                            f"on {r.task}s")
