"""IMDb Large Movie Review Dataset (aclImdb v1.0) loading, cached after the first read.

Sources (``data_dir`` holds one or is one): an ``aclImdb/`` folder, the official
``aclImdb_v1.tar.gz``, or any tar holding ``aclImdb/`` (e.g. ``aclImdb-train.tar.gz``). Splits:
``train`` and ``test`` (``<split>/{neg,pos}``, labels 0/1) and ``unsup`` (``train/unsup``,
label -1). Ratings come from the file names ``<id>_<rating>.txt``. HTML line breaks are
replaced by spaces and whitespace is collapsed. An archive is streamed once and every split
found in it is cached (uncompressed ``.npz``, no pickle: fastest to reload).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vit_service.data import cache
from vit_service.data.archive import (
    NotASource,
    SplitMissing,
    first_source,
    is_archive,
    iter_tar_files,
    not_found,
    peek_archive,
    resolve_data_dir,
)
from vit_service.data.errors import IMDB_HINT, DataNotFoundError

logger = logging.getLogger(__name__)

IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
OFFICIAL_ARCHIVE = "aclImdb_v1.tar.gz"
IMDB_SPLITS = ("train", "test", "unsup")
CLASS_NAMES = ("negative", "positive")
LOADER_VERSION = "1"

# [.../]<train|test>/<pos|neg|unsup>/<id>_<rating>.txt
_REVIEW_RE = re.compile(r"(?:^|/)(train|test)/(pos|neg|unsup)/(\d+)_(\d+)\.txt$")
_BR_RE = re.compile(r"<\s*br\s*/?\s*>", re.IGNORECASE)
_LABELS = {"neg": 0, "pos": 1, "unsup": -1}


@dataclass
class TextDataset:
    """Reviews with labels (1 positive, 0 negative, -1 unlabelled) and star ratings."""

    texts: list[str]
    labels: np.ndarray  # (N,) int64: 1 positive, 0 negative, -1 unlabelled
    ratings: np.ndarray  # (N,) int64: 1-4 negative, 7-10 positive, 0 unlabelled
    ids: list[str]  # "<split dir>/<label dir>/<id>_<rating>", e.g. "train/pos/123_9"
    class_names: list[str] = field(default_factory=lambda: list(CLASS_NAMES))
    source: str = ""  # folder or archive the reviews came from
    from_cache: bool = False  # True when read from the cache

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices: Sequence[int] | np.ndarray) -> TextDataset:
        """A new dataset with the rows at ``indices`` (ints or a boolean mask)."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        rows = [int(i) for i in idx]
        return TextDataset(
            texts=[self.texts[i] for i in rows],
            labels=self.labels[idx],
            ratings=self.ratings[idx],
            ids=[self.ids[i] for i in rows],
            class_names=list(self.class_names),
            source=self.source,
            from_cache=self.from_cache,
        )


def clean_review(text: str) -> str:
    """Replace ``<br />`` variants with spaces and collapse all whitespace to single spaces."""
    return " ".join(_BR_RE.sub(" ", text).split())


def _split_of(kind: str, folder: str) -> str | None:
    """(train|test, pos|neg|unsup) -> dataset split name, None for unknown combinations."""
    if folder == "unsup":
        return "unsup" if kind == "train" else None
    return kind


def _build(records: list[tuple[int, int, int, str, str]], source: Path) -> TextDataset:
    """(label, numeric id, rating, id string, text) records -> dataset sorted by label, id."""
    records.sort(key=lambda r: (r[0], r[1]))
    return TextDataset(
        texts=[r[4] for r in records],
        labels=np.array([r[0] for r in records], dtype=np.int64),
        ratings=np.array([r[2] for r in records], dtype=np.int64),
        ids=[r[3] for r in records],
        source=str(source),
    )


# ----------------------------------------------------------------------------- cache


def _cache_path(cache_dir: str | Path | None, source: Path, fp: Any, split: str) -> Path:
    key = cache.cache_key(fp, version=LOADER_VERSION, params={"split": split})
    return cache.cache_file(cache_dir, "imdb", source, key, f".{split}.npz")


def _store(path: Path, ds: TextDataset) -> None:
    blob = "".join(ds.texts)
    offsets = np.zeros(len(ds.texts) + 1, dtype=np.int64)  # (N + 1,) char offsets into blob
    np.cumsum([len(t) for t in ds.texts], out=offsets[1:])
    cache.save_npz(
        path,
        {
            "text": np.frombuffer(blob.encode("utf-8"), dtype=np.uint8),  # (bytes,) utf-8
            "offsets": offsets,
            "labels": ds.labels,
            "ratings": ds.ratings,
            "ids": np.array(ds.ids, dtype=str),
        },
    )


def _load(path: Path, source: Path) -> TextDataset | None:
    arrays = cache.load_npz(path)
    if arrays is None or not {"text", "offsets", "labels", "ratings", "ids"} <= arrays.keys():
        return None
    blob = arrays["text"].tobytes().decode("utf-8")
    off = arrays["offsets"].tolist()
    return TextDataset(
        texts=[blob[a:b] for a, b in zip(off[:-1], off[1:], strict=True)],
        labels=arrays["labels"].astype(np.int64, copy=False),
        ratings=arrays["ratings"].astype(np.int64, copy=False),
        ids=[str(i) for i in arrays["ids"]],
        source=str(source),
        from_cache=True,
    )


# ----------------------------------------------------------------------------- sources


def _is_imdb_root(folder: Path) -> bool:
    return any((folder / s / d).is_dir() for s in ("train", "test") for d in ("pos", "neg"))


def _load_folder(root: Path, split: str, cache_dir: str | Path | None) -> TextDataset:
    kind = "test" if split == "test" else "train"
    folders = ["unsup"] if split == "unsup" else ["neg", "pos"]
    dirs = [root / kind / f for f in folders if (root / kind / f).is_dir()]
    if not dirs:
        raise SplitMissing(f"{root}: the {split!r} split is not present")
    fp = {"dirs": [cache.fingerprint(d) for d in dirs]}
    path = _cache_path(cache_dir, root, fp, split)
    hit = _load(path, root)
    if hit is not None:
        return hit
    records = []
    for d in dirs:
        for entry in os.scandir(d):
            m = _REVIEW_RE.search(f"{kind}/{d.name}/{entry.name}")
            if m is None or not entry.is_file():
                continue
            text = clean_review(Path(entry.path).read_bytes().decode("utf-8", "replace"))
            num, rating = int(m.group(3)), int(m.group(4))
            rid = f"{kind}/{d.name}/{num}_{rating}"
            records.append((_LABELS[d.name], num, rating, rid, text))
    ds = _build(records, root)
    _store(path, ds)
    return ds


def _load_archive(archive: Path, split: str, cache_dir: str | Path | None) -> TextDataset:
    """Stream the archive once; cache every split found; return ``split``."""
    fp = cache.fingerprint(archive)
    manifest_key = cache.cache_key(fp, version=LOADER_VERSION, params={"what": "splits"})
    manifest_path = cache.cache_file(cache_dir, "imdb", archive, manifest_key, ".splits.json")
    manifest = cache.load_json(manifest_path)
    if isinstance(manifest, dict):
        if split not in manifest:
            found = ", ".join(sorted(manifest)) or "none"
            raise SplitMissing(f"{archive}: the {split!r} split is not present (has: {found})")
        hit = _load(_cache_path(cache_dir, archive, fp, split), archive)
        if hit is not None:
            return hit
    records: dict[str, list[tuple[int, int, int, str, str]]] = {}
    for name, data in iter_tar_files(archive, lambda n: _REVIEW_RE.search(n) is not None):
        m = _REVIEW_RE.search(name)
        if m is None or data is None:
            continue
        kind, folder = m.group(1), m.group(2)
        which = _split_of(kind, folder)
        if which is None:
            continue
        num, rating = int(m.group(3)), int(m.group(4))
        text = clean_review(data.decode("utf-8", "replace"))
        rid = f"{kind}/{folder}/{num}_{rating}"
        records.setdefault(which, []).append((_LABELS[folder], num, rating, rid, text))
    if not records:
        cache.save_json(manifest_path, {})
        raise NotASource(f"{archive}: no aclImdb reviews in this archive")
    datasets = {name: _build(recs, archive) for name, recs in records.items()}
    for name, ds in datasets.items():
        _store(_cache_path(cache_dir, archive, fp, name), ds)
    cache.save_json(manifest_path, {name: len(ds) for name, ds in datasets.items()})
    if split not in datasets:
        found = ", ".join(sorted(datasets))
        raise SplitMissing(f"{archive}: the {split!r} split is not present (has: {found})")
    return datasets[split]


def _candidates(root: Path, looked: list[str], details: list[str]) -> Iterator[tuple[str, Path]]:
    """(kind, path) of possible aclImdb sources under/at ``root``, in preference order."""
    if root.is_dir():
        looked.append(str(root))
        if _is_imdb_root(root):
            yield "folder", root
        looked.append(str(root / "aclImdb"))
        if (root / "aclImdb").is_dir():
            yield "folder", root / "aclImdb"
        archives = sorted(
            (p for p in root.iterdir() if p.is_file() and is_archive(p)),
            key=lambda p: (p.name != OFFICIAL_ARCHIVE, "imdb" not in p.name.lower(), p.name),
        )
        if not archives:
            looked.append(f"{root}/*.tar.gz|*.tgz|*.tar (none found)")
        for archive in archives:
            looked.append(str(archive))
            names = peek_archive(archive)
            if names is None:
                details.append(f"{archive}: unreadable tar archive")
            elif "imdb" in archive.name.lower() or any(
                "aclImdb" in n.split("/") or _REVIEW_RE.search(n) for n in names
            ):
                yield "archive", archive
            else:
                details.append(f"{archive}: does not hold aclImdb/, skipped")
    elif root.is_file():
        looked.append(str(root))
        yield "archive", root
    else:
        looked.append(f"{root} (does not exist)")


def _download(root: Path) -> Path:
    """Fetch the official archive into ``root`` (needs network)."""
    root.mkdir(parents=True, exist_ok=True)
    target = root / OFFICIAL_ARCHIVE
    logger.info("downloading %s into %s", IMDB_URL, target)
    fd, tmp = tempfile.mkstemp(prefix=f".{OFFICIAL_ARCHIVE}.", suffix=".part", dir=root)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(IMDB_URL, timeout=60) as resp:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_imdb(
    data_dir: str | Path | None,
    split: str = "train",
    *,
    cache_dir: str | Path | None = None,
    download: bool = False,
) -> TextDataset:
    """Load an IMDb split (``train``, ``test`` or ``unsup``) as a :class:`TextDataset`.

    ``data_dir`` (None: ``$VIT_SERVICE_DATA_DIR``) holds or is an ``aclImdb/`` folder or a tar
    of one. Rows are sorted by label, then numeric id. With ``download=True`` and nothing
    found, the official archive is fetched into ``data_dir``. Raises
    :class:`DataNotFoundError` listing every path looked at.
    """
    if split not in IMDB_SPLITS:
        raise ValueError(f"split must be one of {IMDB_SPLITS}, got {split!r}")
    t0 = time.perf_counter()
    root = resolve_data_dir(data_dir, IMDB_HINT)
    looked: list[str] = []
    details: list[str] = []

    def load(kind: str, path: Path) -> TextDataset:
        if kind == "folder":
            return _load_folder(path, split, cache_dir)
        return _load_archive(path, split, cache_dir)

    def fetch() -> TextDataset:
        return _load_archive(_download(root), split, cache_dir)

    ds = first_source(_candidates(root, looked, details), load, details,
                      folder_kinds=("folder",), download=fetch if download else None)
    if ds is None:
        raise DataNotFoundError(not_found("IMDb", split, root, details, "IMDb (aclImdb)"), looked,
                                IMDB_HINT, details)
    logger.info(
        "loaded IMDb %s: %d reviews from %s (%s) in %.2fs",
        split,
        len(ds),
        ds.source,
        "cache" if ds.from_cache else "parsed",
        time.perf_counter() - t0,
    )
    return ds
