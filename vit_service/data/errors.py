"""Errors raised by the data loaders."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

CIFAR_HINT = (
    "pass --data-dir pointing at a folder containing cifar-10-batches-py/, "
    "cifar-10-python.tar.gz, an ImageFolder tree (<root>/<split>/<class>/*.jpg) or a .tar.gz "
    "of one such as cifar10-jpeg-train.tar.gz (or pointing directly at one of them); "
    "or set VIT_SERVICE_DATA_DIR; or pass download=True when online"
)
IMAGE_FOLDER_HINT = (
    "pass a path to an ImageFolder tree (<root>/[<split>/]<class>/*.jpg|png) or to a "
    ".tar.gz/.tgz/.tar archive of one"
)
IMDB_HINT = (
    "pass --data-dir pointing at a folder containing aclImdb/ or aclImdb_v1.tar.gz "
    "(or another .tar.gz holding aclImdb/, such as aclImdb-train.tar.gz), or pointing "
    "directly at one of them; or set VIT_SERVICE_DATA_DIR; or pass download=True when online"
)


class DataNotFoundError(FileNotFoundError):
    """A data set (or the requested split of it) could not be found.

    ``looked_at`` holds every path the loader inspected; the message lists them and says how
    to provide the data.
    """

    def __init__(
        self,
        what: str,
        looked_at: Iterable[str | Path] = (),
        hint: str = "",
        details: Iterable[str] = (),
    ) -> None:
        self.what = what
        self.looked_at: list[str] = [str(p) for p in looked_at]
        self.hint = hint
        self.details: list[str] = list(details)
        lines = [what]
        if self.looked_at:
            lines.append("Looked at:")
            lines.extend(f"  - {p}" for p in self.looked_at)
        if self.details:
            lines.append("Found:")
            lines.extend(f"  - {d}" for d in self.details)
        if hint:
            lines.append(f"To provide the data: {hint}.")
        super().__init__("\n".join(lines))

    def __str__(self) -> str:  # OSError's __str__ would prepend errno fields otherwise
        return str(self.args[0])
