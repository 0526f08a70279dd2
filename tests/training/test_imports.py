"""The training modules import in one direction: evaluate <- reporting; tasks (the data) <-
model_setup, objectives, artifacts <- publish; and the trainer's parts (budget, run state,
signals, publish) <- trainer.

Checked on the source with ``ast`` (imports inside functions included), so a lazy import that
closes the circle again fails here even though Python would tolerate it at run time.
"""

from __future__ import annotations

import ast

import pytest

from tests.training.conftest import REPO


def imported_modules(module: str) -> set[str]:
    """Every module ``module`` imports anywhere in its source (``from a import b`` gives ``a``
    and ``a.b``, since ``b`` may be a submodule)."""
    path = REPO / (module.replace(".", "/") + ".py")
    package = REPO / module.replace(".", "/")
    paths = [path] if path.is_file() else sorted(package.glob("*.py"))  # a package: all of it
    assert paths, f"no source for {module}"
    found: set[str] = set()
    nodes = [n for p in paths for n in ast.walk(ast.parse(p.read_text(), str(p)))]
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.rsplit(".", node.level)[0]
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(("module", "forbidden"), [
    ("training.evaluate", {"training.tasks", "training.reporting"}),
    ("training.reporting", {"training.tasks"}),
    # the data side is below what builds, trains and reports on it
    ("training.tasks", {"training.model_setup", "training.objectives", "training.artifacts",
                        "training.reporting", "training.trainer", "training.run"}),
    ("training.publish", {"training.trainer", "training.run", "training.run_budget"}),
    # the trainer's parts are below it: the run composes them, they never import the run
    ("training.run_budget", {"training.trainer"}),
    ("training.run_state", {"training.trainer"}),
    ("training.signals", {"training.trainer"}),
    # the loop is below the entry that assembles and starts a run
    ("training.trainer", {"training.run", "training.cli", "training.ray_train"}),
])
def test_no_import_cycle(module: str, forbidden: set[str]) -> None:
    bad = sorted(m for m in imported_modules(module)
                 if any(m == f or m.startswith(f"{f}.") for f in forbidden))
    assert not bad, f"{module} imports {bad}: the imports must go one way"


def test_the_checker_sees_lazy_imports() -> None:
    # artifacts imports objectives at the top and reporting inside functions
    assert {"training.objectives", "training.reporting"} <= imported_modules(
        "training.artifacts")
