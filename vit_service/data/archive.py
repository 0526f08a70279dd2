"""Source discovery shared by the loaders: the data-dir default, and tar archives streamed once.

:func:`iter_tar_files` reads a (compressed) tar in one pass without extracting it; a small
built-in ustar/GNU/pax reader does the common case much faster than :mod:`tarfile`, which takes
over for anything it does not handle.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import logging
import lzma
import os
import tarfile
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import IO, TypeVar

from vit_service.data.errors import DataNotFoundError

logger = logging.getLogger(__name__)
T = TypeVar("T")

DATA_DIR_ENV = "VIT_SERVICE_DATA_DIR"
# what a damaged or non-tar file raises while being streamed
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


class NotASource(Exception):
    """A candidate path does not hold usable data (the message goes into the final error)."""


class SplitMissing(NotASource):
    """The source exists but does not contain the requested split."""


def first_source(
    candidates: Iterable[tuple[str, Path]],
    load: Callable[[str, Path], T],
    details: list[str],
    *,
    folder_kinds: Collection[str] = (),
    download: Callable[[], T] | None = None,
) -> T | None:
    """The data set of the first candidate ``(kind, path)`` that ``load`` can read, else of
    ``download()`` (None: offline), else None. What each skipped candidate was goes into
    ``details`` for the final :class:`DataNotFoundError`. A candidate that is not a source
    (:class:`NotASource`) or an unreadable archive is skipped; a folder (``folder_kinds``)
    that fails to read as an archive would is a real error and is raised."""
    for kind, path in candidates:
        try:
            return load(kind, path)
        except ARCHIVE_ERRORS as exc:
            if kind in folder_kinds:
                raise
            details.append(f"{path}: unreadable tar archive ({exc})")
        except NotASource as exc:
            details.append(str(exc))
            logger.debug("skipping %s: %s", path, exc)
    if download is not None:
        try:
            return download()
        except NotASource as exc:
            details.append(str(exc))
    return None


def not_found(dataset: str, split: str, root: Path, details: list[str],
              sought: str | None = None) -> str:
    """The first line of a loader's :class:`DataNotFoundError`: the split is missing from
    the data found, or nothing was found at all (``sought``: what was looked for, by default
    ``dataset``)."""
    if any("split is not present" in d for d in details):
        return f"The {dataset} {split!r} split is not present in the data found under {root}."
    return f"No {sought or dataset} data found under {root}."


def is_archive(path: Path) -> bool:
    """True for names ending in a tar suffix (.tar.gz, .tgz, .tar, ...)."""
    name = path.name.lower()
    return any(name.endswith(s) for s in ARCHIVE_SUFFIXES)


def resolve_data_dir(data_dir: str | Path | None, hint: str) -> Path:
    """``data_dir`` or, when None/empty, ``$VIT_SERVICE_DATA_DIR``."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(DATA_DIR_ENV, "")
    if env:
        return Path(env).expanduser()
    raise DataNotFoundError(f"No data directory given and ${DATA_DIR_ENV} is not set.", [], hint)


class _TarFallback(Exception):
    """The fast tar reader met something it does not handle; tarfile takes over."""


_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)


def _open_decompressed(path: Path, stack: contextlib.ExitStack) -> IO[bytes]:
    """Buffered reader over the decompressed bytes of a (possibly compressed) tar file."""
    raw = stack.enter_context(open(path, "rb"))
    magic = raw.read(6)
    raw.seek(0)
    stream: IO[bytes]
    if magic[:2] == b"\x1f\x8b":
        stream = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
    elif magic[:3] == b"BZh":
        stream = stack.enter_context(bz2.BZ2File(raw, "rb"))
    elif magic == b"\xfd7zXZ\x00":
        stream = stack.enter_context(lzma.LZMAFile(raw, "rb"))
    else:
        return raw
    return io.BufferedReader(stream, buffer_size=1 << 20)  # type: ignore[arg-type]


def _tar_number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large values
        if field[0] == 0xFF:
            raise _TarFallback("negative base-256 number")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise _TarFallback(f"bad number field {field!r}") from None


def _parse_pax(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    try:
        while pos < len(data) and data[pos : pos + 1] != b"\0":
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
            out[key.decode()] = value.decode("utf-8", "surrogateescape")
            pos += length
    except ValueError:
        raise _TarFallback("bad pax header") from None
    return out


def _read_exact(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _TarFallback("unexpected end of archive")
    return data


def _skip(f: IO[bytes], n: int) -> None:
    while n > 0:
        chunk = f.read(min(n, 1 << 20))
        if not chunk:
            raise _TarFallback("unexpected end of archive")
        n -= len(chunk)


def _fast_tar_files(
    f: IO[bytes], want: Callable[[str], bool] | None
) -> Iterator[tuple[str, bytes | None]]:
    """Minimal ustar/GNU/pax reader (regular files only); ~10x faster than tarfile."""
    pax: dict[str, str] = {}
    longname: str | None = None
    while True:
        hdr = f.read(_BLOCK)
        if not hdr or hdr == _ZERO_BLOCK:
            return
        if len(hdr) != _BLOCK:
            raise _TarFallback("truncated header")
        if _tar_number(hdr[148:156]) != sum(hdr[:148]) + 256 + sum(hdr[156:]):
            raise _TarFallback("bad header checksum")
        size = _tar_number(hdr[124:136])
        kind = hdr[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            data = _read_exact(f, (size + 511) & ~511)[:size]
            if kind == b"x":
                pax = _parse_pax(data)
            elif kind == b"L":
                longname = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if kind not in (b"0", b"\0", b"7", b"1", b"2", b"3", b"4", b"5", b"6"):
            raise _TarFallback(f"member type {kind!r}")
        name_b = hdr[0:100].split(b"\0", 1)[0]
        if hdr[257:263] == b"ustar\0":  # POSIX ustar: prefix field
            prefix = hdr[345:500].split(b"\0", 1)[0]
            if prefix:
                name_b = prefix + b"/" + name_b
        name = pax.get("path") or longname or name_b.decode("utf-8", "surrogateescape")
        if "size" in pax:
            size = int(pax["size"])
        pax, longname = {}, None
        padded = (size + 511) & ~511
        if kind in (b"0", b"\0", b"7") and not (kind == b"\0" and name.endswith("/")):
            if want is None or want(name):
                data = _read_exact(f, size)
                _skip(f, padded - size)
                yield name, data
            else:
                _skip(f, padded)
                yield name, None
        else:
            _skip(f, padded)


def iter_tar_files(
    path: Path, want: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, bytes | None]]:
    """Stream a tar (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz) once: (name, bytes) per file.

    Every regular file is yielded in archive order; its bytes are read only when ``want`` is
    None or ``want(name)`` is true (else None). A small built-in reader handles plain
    ustar/GNU/pax archives quickly; anything else continues with :mod:`tarfile`.
    """
    yielded = 0
    try:
        with contextlib.ExitStack() as stack:
            for item in _fast_tar_files(_open_decompressed(path, stack), want):
                yielded += 1
                yield item
        return
    except _TarFallback as exc:
        logger.debug("fast tar reader stopped on %s (%s); continuing with tarfile", path, exc)
    with tarfile.open(path, "r|*") as tf:
        seen = 0
        for member in tf:
            if not member.isfile():
                continue
            seen += 1
            if seen <= yielded:
                continue
            data = None
            if want is None or want(member.name):
                fobj = tf.extractfile(member)
                data = fobj.read() if fobj is not None else b""
            yield member.name, data


def peek_archive(path: Path, max_members: int = 16) -> list[str] | None:
    """Names of the first members of a tar archive; None if it is not a readable tar."""
    names: list[str] = []
    try:
        with tarfile.open(path, "r|*") as tf:
            for member in tf:
                names.append(member.name)
                if len(names) >= max_members:
                    break
    except (tarfile.TarError, OSError, EOFError):
        return None
    return names
