"""``vit-service`` command line: the top of the stack, so it imports the layers below lazily.

Sub-commands are contributed by ``training.cli`` (train, recipes, evaluate) and ``serving.cli``
(serve, up, ...); each module exposes ``register(subparsers)`` which adds its commands with
``set_defaults(func=...)``.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
import threading

from vit_service import __version__

COMMAND_MODULES = ("training.cli", "serving.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vit-service",
        description="Train, compare and serve Vision Transformers with their attention maps.",
    )
    parser.add_argument("--version", action="version", version=f"vit-service {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # a layer not installed in this environment
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else getattr(logging, os.environ.get("LOG_LEVEL", "INFO"))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return int(args.func(args) or 0)


def run() -> None:
    """The console entry point: :func:`main`, then a fast exit.

    A finished ``train`` spends 2-3 s (2 CPU cores) in the interpreter's final garbage
    collection of torch's, MLflow's and SQLAlchemy's module graphs (``gc_collect_main`` under
    py-spy), time that a ``budget_minutes`` run cannot plan for. The work a normal exit does
    that matters still happens here: threads are shut down as the interpreter does it
    (``threading._shutdown``: first the threading-atexit hooks, which tell idle
    ``ThreadPoolExecutor`` workers such as MLflow's artifact uploaders to exit, then the join of
    every non-daemon thread; joining those workers without the hooks waits forever), ``atexit``
    handlers run (logging shutdown, ``weakref.finalize`` temp-dir cleanup, multiprocessing
    children) and the standard streams are flushed; only the module teardown is skipped."""
    code = main()
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing left to save
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
