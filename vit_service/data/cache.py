"""On-disk cache helpers: where the cache lives, cache keys, atomic writes.

The cache never lives next to the source data (which may be read-only); it goes to the
``cache_dir`` argument, else ``$VIT_SERVICE_CACHE_DIR``, else ``~/.cache/vit-service``.
Keys combine the source's resolved path, size and mtime (for a folder: of every file in it),
the loader version and the loader parameters, so any change to the source or the decoding
produces a new entry. Arrays are stored as ``.npz`` without pickle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

logger = logging.getLogger(__name__)

CACHE_ENV = "VIT_SERVICE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/vit-service")


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Cache root: the argument, else ``$VIT_SERVICE_CACHE_DIR``, else ``~/.cache/vit-service``."""
    if cache_dir is not None and str(cache_dir) != "":
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV, "")
    if env:
        return Path(env).expanduser()
    return DEFAULT_CACHE_DIR.expanduser()


def _walk_stats(root: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file below ``root``, sorted."""
    out: list[tuple[str, int, int]] = []
    stack = [root]
    while stack:
        current = stack.pop()
        with os.scandir(current) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=True):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=True):
                    st = entry.stat(follow_symlinks=True)
                    rel = os.path.relpath(entry.path, root)
                    out.append((rel, st.st_size, st.st_mtime_ns))
    out.sort()
    return out


def fingerprint(source: str | Path) -> dict[str, Any]:
    """Identity of a source: resolved path plus size/mtime (of every file, for a folder)."""
    path = Path(source).resolve()
    if path.is_dir():
        h = hashlib.sha256()
        stats = _walk_stats(path)
        for rel, size, mtime in stats:
            h.update(f"{rel}\0{size}\0{mtime}\n".encode())
        return {"path": str(path), "kind": "dir", "files": len(stats), "digest": h.hexdigest()}
    st = path.stat()
    return {"path": str(path), "kind": "file", "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_key(
    source: str | Path | Mapping[str, Any], *, version: str, params: Mapping[str, Any]
) -> str:
    """Short hex key from the source fingerprint (or a precomputed one), version and params."""
    fp = dict(source) if isinstance(source, Mapping) else fingerprint(source)
    blob = json.dumps(
        {"source": fp, "version": version, "params": dict(params)}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_file(
    cache_dir: str | Path | None, kind: str, source: str | Path, key: str, suffix: str
) -> Path:
    """``<cache root>/<kind>/<source name>-<key><suffix>`` (a readable, unique name)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source).name)[:60] or "source"
    return resolve_cache_dir(cache_dir) / kind / f"{stem}-{key}{suffix}"


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> bool:
    """Write ``path`` via a temp file in the same folder and ``os.replace``.

    Returns False (after logging a warning) when the cache cannot be written, so callers can
    go on without a cache.
    """
    tmp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600
        os.replace(tmp_name, path)
        tmp_name = None
        return True
    except OSError as exc:
        logger.warning("could not write cache file %s: %s", path, exc)
        return False
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass


def save_npz(path: Path, arrays: Mapping[str, np.ndarray], *, compress: bool = False) -> bool:
    """Atomically save arrays as ``.npz`` (object arrays are refused: no pickle)."""
    for name, arr in arrays.items():
        if np.asarray(arr).dtype == object:
            raise TypeError(f"array {name!r} has dtype object; the cache stores no pickles")
    saver = np.savez_compressed if compress else np.savez
    return atomic_write(path, lambda f: saver(f, **arrays))


def load_npz(path: Path) -> dict[str, np.ndarray] | None:
    """Load every array of an ``.npz`` (no pickle); None when missing or unreadable."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        logger.warning("ignoring unreadable cache file %s: %s", path, exc)
        return None


def save_json(path: Path, obj: Any) -> bool:
    """Atomically write a small JSON document."""
    data = json.dumps(obj, sort_keys=True).encode()
    return atomic_write(path, lambda f: f.write(data))


def load_json(path: Path) -> Any | None:
    """Read a JSON document written by :func:`save_json`; None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
