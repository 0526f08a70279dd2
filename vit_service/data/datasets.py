"""Users' own data sets, kept content-addressed, and read back for training.

:class:`DatasetStore` keeps an upload that passed :mod:`vit_service.data.upload_checks` under
``<root>/<id>/`` (``id``: the first 16 hex digits of its sha256): the file as uploaded
(``data.<format>``), ``meta.json`` (:class:`DatasetInfo`), and for an image set its images as an
ImageFolder tree (``tree/train/<class>/...``, ``tree/val/...``), which the image loaders read. It
is written to a temporary folder and renamed into place, so nothing half-written is ever listed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vit_service.data.upload_checks import (
    DatasetLimits,
    inspect_image_archive,
    inspect_text_table,
    label_name,
    sniff_format,
    table_rows,
)

log = logging.getLogger(__name__)

DATASET_ID = re.compile(r"^[0-9a-f]{16}$")


@dataclass
class DatasetInfo:
    """What a data set holds; ``meta.json`` beside the stored file."""

    id: str
    kind: str  # image | text
    format: str  # zip | tar.gz | csv | jsonl
    filename: str
    sha256: str
    bytes: int
    classes: list[str]
    counts: dict[str, dict[str, int]]  # split -> class -> examples
    stats: dict[str, Any] = field(default_factory=dict)  # image sizes, or text lengths
    created_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TextTable:
    """A labelled text set: ``labels`` index ``class_names`` (sorted)."""

    texts: list[str]
    labels: np.ndarray  # (N,) int64
    class_names: list[str]
    source: str

    def __len__(self) -> int:
        return len(self.texts)


class DatasetStore:
    """Data sets under ``root`` (see the module docstring)."""

    def __init__(self, root: Path, limits: DatasetLimits | None = None) -> None:
        self.root, self.limits = Path(root), limits or DatasetLimits()

    def add(self, upload: Path, filename: str) -> tuple[DatasetInfo, bool]:
        """Check ``upload`` and keep it; returns its info and whether it is new (the same
        bytes uploaded again give the same id). ``upload`` is consumed (moved or deleted)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{time.monotonic_ns()}"
        try:
            kind, fmt = sniff_format(upload, filename)
            if kind == "image":
                classes, counts, stats = inspect_image_archive(upload, fmt, self.limits,
                                                               keep=tmp / "tree")
            else:
                classes, counts, stats = inspect_text_table(upload, fmt, self.limits)
            digest = _sha256(upload)
            info = DatasetInfo(id=digest[:16], kind=kind, format=fmt,
                               filename=Path(filename).name[:200], sha256=digest,
                               bytes=upload.stat().st_size, classes=classes, counts=counts,
                               stats=stats, created_at=time.time())
            final = self.root / info.id
            if (final / "meta.json").is_file():
                return self.get(info.id), False
            tmp.mkdir(exist_ok=True)
            shutil.move(str(upload), tmp / f"data.{fmt}")
            (tmp / "meta.json").write_text(json.dumps(info.to_dict(), indent=1))
            try:
                tmp.rename(final)
            except OSError:
                if (final / "meta.json").is_file():  # a concurrent upload of the same bytes
                    return self.get(info.id), False
                raise
            log.info("data set %s: %s %s, %d classes", info.id, kind, fmt, len(classes))
            return info, True
        finally:
            upload.unlink(missing_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)

    def list(self) -> list[DatasetInfo]:
        if not self.root.is_dir():
            return []
        out = [self.get(p.name) for p in self.root.iterdir()
               if DATASET_ID.match(p.name) and (p / "meta.json").is_file()]
        return sorted(out, key=lambda d: d.created_at, reverse=True)

    def get(self, dataset_id: str) -> DatasetInfo:
        meta = self._dir(dataset_id) / "meta.json"
        if not meta.is_file():
            raise KeyError(dataset_id)
        return DatasetInfo(**json.loads(meta.read_text()))

    def data_path(self, dataset_id: str) -> Path:
        """The file as uploaded."""
        return self._dir(dataset_id) / f"data.{self.get(dataset_id).format}"

    def image_tree(self, dataset_id: str) -> Path:
        """An image set's ImageFolder tree (``train/``, and ``val/`` when it has one)."""
        if self.get(dataset_id).kind != "image":
            raise ValueError(f"data set {dataset_id} holds texts, not images")
        return self._dir(dataset_id) / "tree"

    def text_table(self, dataset_id: str) -> TextTable:
        """A text set's rows, labels indexing its sorted class names."""
        info = self.get(dataset_id)
        if info.kind != "text":
            raise ValueError(f"data set {dataset_id} holds images, not texts")
        path = self.data_path(dataset_id)
        index = {c: i for i, c in enumerate(info.classes)}
        texts: list[str] = []
        labels: list[int] = []
        # the reader that checked the table at upload (encoding, byte-order mark, dialect)
        for _, row in table_rows(path, info.format):
            texts.append(str(row["text"]))
            name = label_name(row["label"])
            # a set uploaded before label_name may name a class "1.0" (and then has no "1")
            labels.append(index[name] if name in index else index[str(row["label"]).strip()])
        return TextTable(texts, np.asarray(labels, dtype=np.int64), list(info.classes),
                         str(path))

    def delete(self, dataset_id: str) -> None:
        d = self._dir(dataset_id)
        if not (d / "meta.json").is_file():
            raise KeyError(dataset_id)
        trash = self.root / f".del-{dataset_id}-{time.monotonic_ns()}"
        d.rename(trash)  # gone from listings at once
        shutil.rmtree(trash, ignore_errors=True)

    def _dir(self, dataset_id: str) -> Path:
        if not DATASET_ID.match(dataset_id):
            raise KeyError(dataset_id)
        return self.root / dataset_id


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
