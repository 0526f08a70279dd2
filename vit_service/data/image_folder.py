"""ImageFolder trees (``[<root>/][<split>/]<class>/*.jpg|png``), as a folder or a tar archive
of one (streamed once, never extracted), decoded into an :class:`ImageDataset` through the
decode cache of :mod:`vit_service.data.images`.

Class names are sorted by name (as torchvision's ``ImageFolder``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vit_service.data import cache
from vit_service.data.archive import (
    ARCHIVE_ERRORS,
    NotASource,
    SplitMissing,
    is_archive,
    iter_tar_files,
    peek_archive,
)
from vit_service.data.errors import IMAGE_FOLDER_HINT, DataNotFoundError
from vit_service.data.images import (
    LOADER_VERSION,
    NOT_IMAGE_FOLDERS,
    ImageDataset,
    ImageDecoder,
    is_image_name,
    log_loaded,
    lookup_cached,
    stack_images,
    store_cached,
)

logger = logging.getLogger(__name__)


def _has_image_file(folder: Path) -> bool:
    try:
        with os.scandir(folder) as it:
            return any(e.is_file() and is_image_name(e.name) for e in it)
    except OSError:
        return False


def _subdirs(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return sorted(Path(e.path) for e in it if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def find_image_folder_roots(path: Path, max_depth: int = 2) -> list[Path]:
    """Folders at most ``max_depth`` below ``path`` whose subfolders (classes) hold images.

    Returned shallowest first, then by name. A found root is not searched further.
    """
    roots: list[Path] = []
    level = [path]
    for _depth in range(max_depth + 1):
        nxt: list[Path] = []
        for folder in level:
            if folder.name in NOT_IMAGE_FOLDERS:
                continue
            subs = _subdirs(folder)
            if any(_has_image_file(s) for s in subs):
                roots.append(folder)
            else:
                nxt.extend(subs)
        level = nxt
    return roots


def _choose_root(roots: Sequence[str], split: str | None, where: Path) -> str:
    """Pick the ImageFolder root for ``split`` among relative root paths ('' = top level)."""
    if split is not None:
        matching = [r for r in roots if r.split("/")[-1] == split]
        if not matching:
            found = sorted({r.split("/")[-1] or "<top level>" for r in roots})
            raise SplitMissing(
                f"{where}: the {split!r} split is not present "
                f"(ImageFolder tree has only: {', '.join(found)})"
            )
        return min(matching, key=lambda r: (r.count("/"), r))
    if len(roots) == 1:
        return roots[0]
    shallow = min(r.count("/") if r else -1 for r in roots)
    top = [r for r in roots if (r.count("/") if r else -1) == shallow]
    if len(top) == 1:
        return top[0]
    raise ValueError(
        f"{where} holds several ImageFolder roots ({', '.join(sorted(top))}); pass split="
    )


def _assemble(
    items: list[tuple[str, str, np.ndarray]], image_size: int, source: Path
) -> ImageDataset:
    """(class, file name, image) triples -> dataset sorted by class then file name."""
    class_names = sorted({c for c, _, _ in items})
    index = {c: i for i, c in enumerate(class_names)}
    items = sorted(items, key=lambda t: (t[0], t[1]))
    images = stack_images([im for _, _, im in items], image_size)
    labels = np.array([index[c] for c, _, _ in items], dtype=np.int64)  # (N,)
    return ImageDataset(images, labels, class_names, source=str(source))


def load_image_folder_dir(
    root: Path, image_size: int, cache_dir: str | Path | None
) -> ImageDataset:
    fp = cache.fingerprint(root)
    params = {"loader": "imagefolder", "image_size": image_size}
    path, hit = lookup_cached(cache_dir, root, fp, params)
    if hit is not None:
        return hit
    decoder = ImageDecoder(image_size)
    for class_dir in _subdirs(root):
        for entry in sorted(os.scandir(class_dir), key=lambda e: e.name):
            if entry.is_file() and is_image_name(entry.name):
                decoder.add((class_dir.name, entry.name), Path(entry.path).read_bytes())
    items = [(cls, fname, im) for (cls, fname), im in decoder.finish()]
    if not items:
        raise NotASource(f"{root}: no images in class folders")
    ds = _assemble(items, image_size, root)
    store_cached(path, ds)
    return ds


def _split_member(name: str) -> tuple[str, str, str] | None:
    """Tar member name -> (root, class, file) for ``[root/]class/file.<image ext>``."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if len(parts) < 2 or not is_image_name(parts[-1]):
        return None
    return "/".join(parts[:-2]), parts[-2], parts[-1]


def load_image_folder_archive(
    archive: Path, split: str | None, image_size: int, cache_dir: str | Path | None
) -> ImageDataset:
    """Stream a tar of an ImageFolder tree once, decoding members of the requested root."""
    fp = cache.fingerprint(archive)
    manifest_key = cache.cache_key(fp, version=LOADER_VERSION, params={"what": "roots"})
    manifest_path = cache.cache_file(cache_dir, "images", archive, manifest_key, ".roots.json")
    manifest = cache.load_json(manifest_path)
    chosen: str | None = None
    if isinstance(manifest, list):
        if not manifest:
            raise NotASource(f"{archive}: no ImageFolder images in this archive")
        chosen = _choose_root(manifest, split, archive)  # raises SplitMissing early
    params = {"loader": "imagefolder", "image_size": image_size, "split": split}
    path, hit = lookup_cached(cache_dir, archive, fp, params)
    if hit is not None:
        return hit

    def wanted(root: str) -> bool:
        if chosen is not None:
            return root == chosen
        return split is None or root.split("/")[-1] == split

    roots: set[str] = set()
    decoder = ImageDecoder(image_size)
    parsed_names: dict[str, tuple[str, str, str] | None] = {}

    def want(name: str) -> bool:
        parsed = parsed_names[name] = _split_member(name)
        return parsed is not None and wanted(parsed[0])

    for name, data in iter_tar_files(archive, want):
        parsed = parsed_names.pop(name, None)
        if parsed is None:
            continue
        roots.add(parsed[0])
        if data is not None:
            decoder.add(parsed, data)
    items: dict[str, list[tuple[str, str, np.ndarray]]] = {}
    for (root, cls, fname), im in decoder.finish():
        items.setdefault(root, []).append((cls, fname, im))
    cache.save_json(manifest_path, sorted(roots))
    if not roots:
        raise NotASource(f"{archive}: no ImageFolder images in this archive")
    chosen = _choose_root(sorted(roots), split, archive)
    if chosen not in items:
        raise NotASource(f"{archive}: no decodable images under {chosen or '<top level>'}")
    ds = _assemble(items[chosen], image_size, archive)
    store_cached(path, ds)
    return ds


def load_image_folder(
    path: str | Path,
    split: str | None = None,
    image_size: int = 32,
    cache_dir: str | Path | None = None,
) -> ImageDataset:
    """Load any ImageFolder tree (``[<root>/][<split>/]<class>/*.jpg``) or a tar archive of one.

    With ``split`` given, the class folders are those of the folder named ``split``; without,
    the tree must have a single (shallowest) root. Images are converted to RGB, resized so the
    shorter side is ``image_size`` and centre-cropped. Decoded arrays are cached.
    """
    t0 = time.perf_counter()
    src = Path(path).expanduser()
    try:
        if src.is_file():
            if not is_archive(src) and peek_archive(src) is None:
                raise NotASource(f"{src}: neither a folder nor a tar archive")
            try:
                ds = load_image_folder_archive(src, split, image_size, cache_dir)
            except ARCHIVE_ERRORS as exc:
                raise NotASource(f"{src}: unreadable tar archive ({exc})") from None
        elif src.is_dir():
            rel_roots = {
                os.path.relpath(r, src).replace(os.sep, "/"): r
                for r in find_image_folder_roots(src)
            }
            rel_roots = {("" if k == "." else k): v for k, v in rel_roots.items()}
            if not rel_roots:
                raise NotASource(f"{src}: no <class>/<image> folders within two levels")
            if split is not None and src.name == split and "" in rel_roots:
                chosen = ""
            else:
                chosen = _choose_root(sorted(rel_roots), split, src)
            ds = load_image_folder_dir(rel_roots[chosen], image_size, cache_dir)
        else:
            raise NotASource(f"{src}: does not exist")
    except NotASource as exc:
        raise DataNotFoundError(
            f"No ImageFolder data found at {src}", [src], IMAGE_FOLDER_HINT, [str(exc)]
        ) from None
    log_loaded("loaded ImageFolder", ds, t0)
    return ds


def load_image_folder_train(
    path: str | Path, image_size: int = 32, cache_dir: str | Path | None = None
) -> ImageDataset:
    """A training run's ``data.path``: an ImageFolder tree or a tar of one; when it has several
    roots (``train/``, ``test/``...), its ``train`` root."""
    try:
        return load_image_folder(path, None, image_size=image_size, cache_dir=cache_dir)
    except ValueError as e:
        if "several ImageFolder roots" not in str(e):
            raise
        return load_image_folder(path, "train", image_size=image_size, cache_dir=cache_dir)
