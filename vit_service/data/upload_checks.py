"""An uploaded data set, checked member by member (or line by line) before it is kept.

Two kinds:

* ``image``: an ImageFolder tree as ``.zip`` or ``.tar.gz`` (``[<root>/][train|val/]<class>/
  <file>``; a ``val/`` split is optional). Every member's path is checked (no absolute path, no
  ``..``, no link or device), the archive's expansion is capped (member count, bytes, the
  compression ratio of each member: a zip bomb is refused before it is inflated), and every
  image is decoded (its pixel count checked from the header first).
* ``text``: a labelled table as CSV (a header with ``text`` and ``label`` columns) or JSON
  Lines (one object per line with ``text`` and ``label``).

Both need at least two classes and ``min_per_class`` examples of each in the train part. A
failure raises :class:`DatasetError` naming the member or the line. :class:`DatasetStore` keeps
an accepted upload under ``<root>/<id>/`` (``id``: the first 16 hex digits of its sha256),
written to a temporary folder and renamed into place, so nothing half-written is ever listed.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import lzma
import math
import posixpath
import statistics
import tarfile
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vit_service.data.tokenizer import text_problem

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
IGNORED = ("__MACOSX/", ".DS_Store", "Thumbs.db")  # what archivers add beside the tree
ZIP_MAGIC, GZIP_MAGIC = b"PK\x03\x04", b"\x1f\x8b"


class DatasetError(ValueError):
    """An upload that is not a usable data set; the message says which member or line."""


@dataclass(frozen=True)
class DatasetLimits:
    """What one upload may expand to (the upload's own size is capped by the server)."""

    max_members: int = 200_000  # files in an archive
    max_expanded_bytes: int = 4 * 2**30  # the archive's members, inflated
    max_ratio: float = 200.0  # a member's inflated / compressed size (zip bombs exceed it)
    max_image_pixels: int = 12_000_000  # per image, read from its header before decoding
    min_per_class: int = 5  # examples of each class in the train part
    max_classes: int = 1000
    max_text_chars: int = 100_000  # per text row
    max_name_bytes: int = 200  # per folder or file name in an archive (kept with a prefix,
    # under the 255 bytes a file system allows)


# ----------------------------------------------------------------------------- images


def _member_path(name: str, limits: DatasetLimits) -> str | None:
    """The member's normalised relative path, or None for what archivers add beside the
    tree; a path that escapes the archive, is not text or has a name too long to keep
    raises."""
    if any(part in name for part in IGNORED) or name.endswith("/"):
        return None
    problem = text_problem(name)
    if problem:
        raise DatasetError(f"member {name!r}: its name {problem}")
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise DatasetError(f"member {name!r}: absolute paths are not allowed")
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        raise DatasetError(f"member {name!r}: '..' is not allowed in a member path")
    path = posixpath.normpath(name.replace("\\", "/"))
    if any(len(p.encode()) > limits.max_name_bytes for p in path.split("/")):
        raise DatasetError(f"member {name!r}: a folder or file name is longer than "
                           f"{limits.max_name_bytes} bytes")
    base = posixpath.basename(path)
    return None if base.startswith(".") else path


def _zip_members(path: Path, limits: DatasetLimits) -> Iterator[tuple[str, bytes]]:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        # ValueError: a member name flagged UTF-8 that is not (UnicodeDecodeError)
        raise DatasetError(f"not a readable zip archive: {e}") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            raise DatasetError(f"{len(infos)} members: at most {limits.max_members} allowed")
        total = 0
        for info in infos:
            name = _member_path(info.filename, limits)
            if name is None or info.is_dir():
                continue
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise DatasetError(f"member {info.filename!r}: links are not allowed")
            ratio = info.file_size / max(1, info.compress_size)
            if ratio > limits.max_ratio:
                raise DatasetError(f"member {info.filename!r} inflates {ratio:.0f}x: at most "
                                   f"{limits.max_ratio:.0f}x allowed (a zip bomb?)")
            total += info.file_size
            if total > limits.max_expanded_bytes:
                raise DatasetError(f"the archive inflates past {limits.max_expanded_bytes} "
                                   "bytes")
            try:
                yield name, zf.read(info)
            except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError,
                    zlib.error, lzma.LZMAError) as e:  # unknown method; encrypted; corrupt
                raise DatasetError(f"member {info.filename!r} cannot be read: {e}") from None


def _tar_members(path: Path, limits: DatasetLimits) -> Iterator[tuple[str, bytes]]:
    compressed = path.stat().st_size
    try:
        tf = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(f"not a readable tar.gz archive: {e}") from None
    with tf:
        total = count = 0
        try:
            for m in tf:
                count += 1
                if count > limits.max_members:
                    raise DatasetError(f"more than {limits.max_members} members")
                if m.isdir():
                    continue
                name = _member_path(m.name, limits)
                if name is None:
                    continue
                if not m.isfile():
                    raise DatasetError(f"member {m.name!r}: only regular files are allowed")
                total += m.size
                cap = min(limits.max_expanded_bytes, int(limits.max_ratio * compressed))
                if total > cap:
                    raise DatasetError(f"the archive inflates past {cap} bytes, "
                                       f"{limits.max_ratio:.0f}x its size (a gzip bomb?)")
                f = tf.extractfile(m)
                yield name, f.read() if f is not None else b""
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            if isinstance(e, DatasetError):
                raise
            raise DatasetError(f"the archive is corrupt: {e}") from None


def _split_class(parts: list[str]) -> tuple[str, str] | None:
    """``[train|val/]<class>/<file>`` -> (split, class); None for a file outside classes."""
    if len(parts) >= 3 and parts[-3] in SPLITS:
        return parts[-3], parts[-2]
    if len(parts) >= 2:
        return "train", parts[-2]
    return None


def _strip_root(names: list[str]) -> int:
    """How many leading folders every member shares (a tree zipped with its top folder)."""
    split = [n.split("/")[:-1] for n in names]
    depth = 0
    while (split and all(len(s) > depth + 1 for s in split)
           and len({s[depth] for s in split}) == 1 and split[0][depth] not in SPLITS):
        depth += 1
    return depth


def inspect_image_archive(path: Path, fmt: str, limits: DatasetLimits,
                          keep: Path | None = None) -> tuple[
        list[str], dict[str, dict[str, int]], dict[str, Any]]:
    """Classes, counts per split and image size statistics of an ImageFolder archive. With
    ``keep``, the images are also written there as ``<split>/<class>/<n>_<file>`` (an
    ImageFolder tree with a ``train/`` root, and ``val/`` when the archive has one)."""
    members = _zip_members(path, limits) if fmt == "zip" else _tar_members(path, limits)
    decoded: list[tuple[str, int, int]] = []  # (member, width, height), decoded as streamed
    raw = keep / ".raw" if keep is not None else None
    if raw is not None:
        raw.mkdir(parents=True)
    for name, data in members:
        try:
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > limits.max_image_pixels:
                    raise DatasetError(f"member {name!r}: {w}x{h} pixels, at most "
                                       f"{limits.max_image_pixels} allowed")
                img.load()
        except DatasetError:
            raise
        except Exception as e:  # PIL raises many kinds for a corrupt file
            raise DatasetError(f"member {name!r} is not a decodable image "
                               f"({type(e).__name__})") from None
        if raw is not None:
            (raw / str(len(decoded))).write_bytes(data)
        decoded.append((name, w, h))
    depth = _strip_root([n for n, _, _ in decoded])
    seen: list[tuple[str, str, str]] = []  # (member, split, class)
    for name, _, _ in decoded:
        where = _split_class(name.split("/")[depth:])
        if where is None:
            raise DatasetError(f"member {name!r} is not inside a class folder "
                               "([train|val/]<class>/<file>)")
        seen.append((name, *where))
    if keep is not None and raw is not None:
        for n, (name, split, cls) in enumerate(seen):
            folder = keep / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            (raw / str(n)).rename(folder / f"{n}_{posixpath.basename(name)}")
        raw.rmdir()
    widths, heights = [w for _, w, _ in decoded], [h for _, _, h in decoded]
    counts: dict[str, dict[str, int]] = {}
    for _, split, cls in seen:
        counts.setdefault(split, Counter())[cls] += 1  # type: ignore[index]
    stats = ({"width": _summary(widths), "height": _summary(heights)} if widths else {})
    return _check_classes(counts, limits), {s: dict(c) for s, c in counts.items()}, stats


# ----------------------------------------------------------------------------- text


def table_rows(path: Path, fmt: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of a CSV or JSON Lines file."""
    # utf-8-sig: a byte-order mark (spreadsheet exports write one) is not part of the header
    with path.open(encoding="utf-8-sig", newline="") as f:
        try:
            if fmt == "csv":
                reader = csv.DictReader(f, strict=True)  # strict: an unclosed quote raises
                missing = {"text", "label"} - set(reader.fieldnames or [])
                if missing:
                    raise DatasetError(f"line 1: the header lacks the column(s) "
                                       f"{', '.join(sorted(missing))} (have "
                                       f"{', '.join(reader.fieldnames or []) or 'none'})")
                for row in reader:
                    yield reader.line_num, row
                return
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"line {n}: not JSON ({e.msg})") from None
                except (ValueError, RecursionError) as e:  # a 5,000-digit int; deep nesting
                    raise DatasetError(f"line {n}: not a usable JSON object "
                                       f"({type(e).__name__})") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"line {n}: a JSON object with text and label expected")
                yield n, row
        except UnicodeDecodeError as e:
            raise DatasetError(f"not UTF-8 text (byte {e.start})") from None
        except csv.Error as e:
            raise DatasetError(f"not a readable CSV file: {e}") from None


def label_name(label: Any) -> str:
    """The class name of a table's label: its text, stripped. A JSON number names its value,
    so ``1`` and ``1.0`` are one class ("1"); CSV labels are text and stay as written."""
    if (isinstance(label, float) and label.is_integer()
            and abs(label) < 2**53):  # exact as an int; beyond, floats skip integers
        label = int(label)
    return str(label).strip()


def inspect_text_table(path: Path, fmt: str, limits: DatasetLimits) -> tuple[
        list[str], dict[str, dict[str, int]], dict[str, Any]]:
    """Classes, counts and text length statistics of a labelled CSV / JSON Lines file."""
    counts: Counter[str] = Counter()
    words: list[int] = []
    for n, row in table_rows(path, fmt):
        text, label = row.get("text"), row.get("label")
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"line {n}: 'text' is missing or empty")
        if label is None or (isinstance(label, str) and not label.strip()):
            raise DatasetError(f"line {n}: 'label' is missing or empty")
        if isinstance(label, (dict, list)) or (
                isinstance(label, float) and not math.isfinite(label)):
            raise DatasetError(f"line {n}: 'label' must be a string or a finite number")
        name = label_name(label)
        for field, value in (("text", text), ("label", name)):
            problem = text_problem(value)
            if problem:
                raise DatasetError(f"line {n}: {field!r} {problem}")
        if len(text) > limits.max_text_chars:
            raise DatasetError(f"line {n}: {len(text)} characters, at most "
                               f"{limits.max_text_chars} allowed")
        counts[name] += 1
        words.append(len(text.split()))
    split = {"train": dict(counts)}
    return _check_classes(split, limits), split, ({"words": _summary(words)} if words else {})


# ----------------------------------------------------------------------------- shared


def _summary(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "mean": round(statistics.fmean(values), 1)}


def _check_classes(counts: dict[str, Any], limits: DatasetLimits) -> list[str]:
    train = counts.get("train") or {}
    classes = sorted(train)
    if len(classes) < 2:
        raise DatasetError(f"{len(classes)} class(es) in the train part: at least 2 needed")
    if len(classes) > limits.max_classes:
        raise DatasetError(f"{len(classes)} classes: at most {limits.max_classes} allowed")
    few = {c: n for c, n in train.items() if n < limits.min_per_class}
    if few:
        shown = ", ".join(f"{c}: {n}" for c, n in sorted(few.items())[:5])
        raise DatasetError(f"at least {limits.min_per_class} examples per class needed in the "
                           f"train part ({shown})")
    unknown = set(counts.get("val") or {}) - set(classes)
    if unknown:
        raise DatasetError(f"val/ has classes the train part lacks: {', '.join(sorted(unknown))}")
    return classes


def sniff_format(path: Path, filename: str) -> tuple[str, str]:
    """(kind, format) of an upload, from its first bytes, else its name."""
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(ZIP_MAGIC):
        return "image", "zip"
    if head.startswith(GZIP_MAGIC):
        return "image", "tar.gz"
    lower = filename.lower()
    if lower.endswith(".csv"):
        return "text", "csv"
    if lower.endswith((".jsonl", ".ndjson", ".json")):
        return "text", "jsonl"
    raise DatasetError(f"{filename!r}: expected an ImageFolder .zip / .tar.gz, or a .csv / "
                       ".jsonl table with text and label")


