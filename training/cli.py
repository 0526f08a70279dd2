"""``vit-service train | recipes | evaluate`` (registered into :mod:`vit_service.cli`).

Exit codes: 0 done; 2 bad usage, bad recipe or missing data (a clear message, no traceback);
143 stopped by SIGTERM (130 by SIGINT) after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.progress import ERROR_PREFIX

EXIT_USAGE = 2
# recipe keys that may change when resuming (they do not change what is computed)
RESUME_KEYS = {"max_steps", "device", "threads", "processes", "log_every", "eval_batch_size",
               "checkpoint_every"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train", help="train a model from a recipe",
        description="Train RECIPE (a name from `vit-service recipes` or a YAML path), log it to "
        "MLflow and register the model. Progress: a bar on a terminal, JSON lines otherwise.")
    p.add_argument("recipe", help="recipe name or path to a recipe YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value, dotted (optim.lr=1e-3); repeatable")
    p.add_argument("--data-dir", help="data folder or archive (default: $VIT_SERVICE_DATA_DIR "
                   "or ./data)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI "
                   "or SQLite under $VIT_SERVICE_HOME)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], help="override recipe.device")
    p.add_argument("--max-steps", type=int, help="stop after N steps (schedule unchanged)")
    p.add_argument("--subset", type=int, help="train on N examples (data.subset)")
    p.add_argument("--resume", metavar="PATH|auto|if-exists", help="continue from a checkpoint, "
                   "a run folder, or `auto` (latest checkpoint of --run-name or of this recipe); "
                   "`if-exists`: the --run-name's checkpoint when it has one, else start afresh "
                   "(what a job executor that cannot see the run folder asks)")
    p.add_argument("--run-name", help="run name (default: <recipe>-<timestamp>); the run folder "
                   "is $VIT_SERVICE_HOME/runs/<run-name>")
    p.add_argument("--no-register", action="store_true",
                   help="log the model to the run but do not register or promote it")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser("recipes", help="list recipes, or show one resolved",
                              description="`recipes` lists recipes; `recipes show NAME` prints "
                              "the resolved YAML (with --set overrides applied).")
    p.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    p.add_argument("name", nargs="?")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_recipes)

    p = subparsers.add_parser(
        "evaluate", help="evaluate a trained model on the val or test split",
        description="MODEL: a bundle folder, a registered name (its @champion), or "
        "models:/name@alias | models:/name/version.")
    p.add_argument("model")
    p.add_argument("--split", choices=["val", "test"], default="val")
    p.add_argument("--data-dir")
    p.add_argument("--tracking-uri")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--precision", choices=["fp32", "bf16", "auto"], default="fp32",
                   help="run the model as the server does in this precision (auto: bf16 on a "
                   "CPU with native bf16, the server's default)")
    p.set_defaults(func=cmd_evaluate)


def _settings() -> Any:
    from vit_service.config import Settings

    return Settings()  # fresh: reads the environment now


def _fail(msg: str) -> int:
    print(f"{ERROR_PREFIX}{msg}", file=sys.stderr)
    return EXIT_USAGE


def cmd_train(args: argparse.Namespace) -> int:
    from training.recipes import RecipeError
    from vit_service.data import DataNotFoundError

    settings = _settings()
    if args.resume == "if-exists":
        if not args.run_name:
            return _fail("--resume if-exists needs --run-name")
        args.resume = "auto" if _has_checkpoint(settings, args.run_name) else None
    try:
        recipe, resume_overrides = _train_recipe(args, settings)
    except (RecipeError, FileNotFoundError) as e:
        return _fail(str(e))

    from training import launch

    processes = int(resume_overrides.get("processes", recipe.processes))
    if processes > 1 and not launch.is_rank():
        from training.distributed import resolve_device

        device = resume_overrides.get("device", recipe.device)
        if device != "cuda" and resolve_device(device).type == "cpu":
            return launch.launch(processes, launch.train_command(_rank_argv(args)),
                                 process_started_at())
        print(f"processes={processes} applies to the CPU; on CUDA launch the ranks with "
              "torchrun (docs/training.md, DDP): training in this one process",
              file=sys.stderr)

    from training.run import train

    try:
        result = train(recipe, data_dir=args.data_dir or settings.data_dir,
                       run_name=args.run_name, resume=args.resume,
                       resume_overrides=resume_overrides, tracking_uri=args.tracking_uri,
                       register=not args.no_register, settings=settings,
                       started_at=launch.started_at_from_env() or process_started_at())
    except (DataNotFoundError, RecipeError, FileNotFoundError) as e:
        return _fail(str(e))
    return result.exit_code


def _has_checkpoint(settings: Any, run_name: str) -> bool:
    from training.checkpoint import find_checkpoint

    try:
        find_checkpoint(Path(settings.home) / "runs", "auto", run_name)
        return True
    except FileNotFoundError:
        return False


def _train_recipe(args: argparse.Namespace, settings: Any) -> tuple[Any, dict[str, Any]]:
    """The recipe ``train`` runs and the execution settings a resumed run may change
    (``--max-steps``, ``--device`` and the ``RESUME_KEYS`` of ``--set``). With ``--resume``
    the checkpoint's recipe is used: other ``--set`` keys may only repeat its values (the
    command line that started the run, re-run with ``--resume auto`` after a kill)."""
    from training.recipes import RecipeError, load_recipe, parse_overrides

    overrides: dict[str, Any] = parse_overrides(args.overrides)
    if args.subset is not None:
        overrides["data.subset"] = args.subset
    resume_overrides: dict[str, Any] = {}
    if args.max_steps is not None:
        resume_overrides["max_steps"] = args.max_steps
    if args.device is not None:
        resume_overrides["device"] = args.device
    if not args.resume:
        return load_recipe(args.recipe, {**overrides, **resume_overrides}), resume_overrides
    recipe = load_recipe(args.recipe, {})
    fixed = {k: v for k, v in overrides.items() if k not in RESUME_KEYS}
    if fixed:
        changed = resume_conflicts(
            _checkpoint_recipe(settings, args.resume, args.run_name, recipe.name), fixed)
        if changed:
            raise RecipeError(
                "--resume continues the checkpoint's recipe; only execution settings "
                f"may change ({', '.join(sorted(RESUME_KEYS))}), other keys only "
                "repeat the checkpoint's values", changed)
    resume_overrides.update({k: v for k, v in overrides.items() if k in RESUME_KEYS})
    return recipe, resume_overrides


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` arguments each rank of a ``processes: N`` run gets: this command's, with
    ``--resume if-exists`` already resolved (so that every rank resumes, or none)."""
    argv = [args.recipe]
    for o in args.overrides:
        argv += ["--set", o]
    for flag, value in (("--data-dir", args.data_dir), ("--tracking-uri", args.tracking_uri),
                        ("--device", args.device), ("--max-steps", args.max_steps),
                        ("--subset", args.subset), ("--resume", args.resume),
                        ("--run-name", args.run_name)):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_register:
        argv.append("--no-register")
    return argv


def process_started_at() -> float:
    """This process's start on the ``time.monotonic()`` clock: a ``budget_minutes`` run counts
    its interpreter start-up and imports too.

    On Linux the age comes from ``/proc/self/stat`` (start in clock ticks since boot) against
    ``/proc/uptime``, both on the boot clock, to ~10 ms; psutil's ``create_time()`` adds the
    boot time, a whole second in ``/proc/stat``, and so could make a run up to 1 s older than
    it is. Elsewhere psutil, else this moment."""
    import time

    age = 0.0
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            age = time.time() - psutil.Process().create_time()
        except Exception:  # psutil missing: count from here
            age = 0.0
    return time.monotonic() - max(0.0, age)


_MISSING = object()


def resume_conflicts(ckpt_recipe: Mapping[str, Any], overrides: Mapping[str, Any]
                     ) -> list[tuple[str, str]]:
    """``(key, message)`` for each dotted override that would change the checkpoint's recipe
    (``ckpt["recipe"]``); execution settings (:data:`RESUME_KEYS`) and overrides whose parsed
    value equals the checkpoint's are not conflicts."""
    from training.recipes import parse_override

    out: list[tuple[str, str]] = []
    for key, value in overrides.items():
        if key in RESUME_KEYS:
            continue
        want = parse_override(key, value)  # as apply_overrides reads it
        have = _lookup(ckpt_recipe, key)
        if have is _MISSING:
            out.append((key, f"not in the checkpoint's recipe (requested {want!r})"))
        elif not _same_value(have, want):
            out.append((key, f"the checkpoint has {have!r}, requested {want!r}"))
    return out


def _lookup(d: Mapping[str, Any], key: str) -> Any:
    """The value at dotted ``key`` (a leaf, or a whole table), or ``_MISSING``."""
    node: Any = d
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _same_value(a: Any, b: Any) -> bool:
    """Equal as recipe values: ``6 == 6.0`` and ``[1, 2] == (1, 2)``, but a bool is not 1/0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _checkpoint_recipe(settings: Any, resume: str, run_name: str | None, recipe_name: str
                       ) -> Mapping[str, Any]:
    """The recipe stored in the checkpoint ``--resume`` designates (found as the trainer does)."""
    from training.checkpoint import find_checkpoint, load_checkpoint

    path = find_checkpoint(Path(settings.home) / "runs", str(resume), run_name, recipe_name)
    return load_checkpoint(path)["recipe"]


def cmd_recipes(args: argparse.Namespace) -> int:
    from training.recipes import RecipeError, list_recipes, load_recipe, parse_overrides

    if args.action == "list" and args.name is None:
        rows = list_recipes()
        width = max(map(len, rows), default=0)
        for name, desc in rows.items():
            print(f"{name:<{width}}  {desc}")
        return 0
    name = args.name
    if name is None:
        return _fail("usage: vit-service recipes show NAME")
    try:
        print(load_recipe(name, parse_overrides(args.overrides)).to_yaml(), end="")
    except RecipeError as e:
        return _fail(str(e))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException

    from training.evaluate import evaluate_bundle
    from vit_service import tracking
    from vit_service.data import DataNotFoundError
    from vit_service.precision import resolve_precision

    settings = _settings()
    tracking.configure(args.tracking_uri, settings)
    device = args.device
    if device == "auto":
        from training.distributed import resolve_device

        device = str(resolve_device("auto"))
    try:
        res = evaluate_bundle(args.model, args.split, args.data_dir or settings.data_dir,
                              settings.cache_dir, args.batch_size, device, args.precision)
    except DataNotFoundError as e:
        return _fail(str(e))
    except (MlflowException, FileNotFoundError, ValueError) as e:
        return _fail(f"cannot evaluate {args.model!r}: {e}")
    print(f"model {args.model}  split {args.split}  "
          f"precision {resolve_precision(args.precision, device)}")
    print(res.format_table())
    return 0
