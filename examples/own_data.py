"""Two data sets of your own, made from the public archives, for the README's walk-through.

* ``images``: an ImageFolder ``.zip`` (``train/<class>/*.jpg`` and ``val/<class>/*.jpg``) of a
  few CIFAR-10 classes, ``--per-class`` training images and ``--val-per-class`` held-out ones
  each, read from the CIFAR-10 JPEG archive (``cifar10-jpeg/train/<class>/<n>.jpg``).
* ``stars``: a CSV (``text,label``) of the labelled IMDb reviews, labelled by the star rating in
  each file name (``<id>_<rating>.txt``) in four classes: ``1-2``, ``3-4``, ``7-8``, ``9-10``.

    python examples/own_data.py images /path/cifar10-jpeg-train.tar.gz pets.zip \
        --classes cat,dog,horse
    python examples/own_data.py stars /path/aclImdb-train.tar.gz stars.csv

Both files are then uploaded with ``POST /v1/datasets`` (README, "Your own data").
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import tarfile
import zipfile
from collections import defaultdict
from pathlib import Path

STARS = {1: "1-2", 2: "1-2", 3: "3-4", 4: "3-4", 7: "7-8", 8: "7-8", 9: "9-10", 10: "9-10"}
_REVIEW = re.compile(r"(?:^|/)train/(pos|neg)/\d+_(\d+)\.txt$")


def image_subset(archive: Path, out: Path, classes: list[str], per_class: int,
                 val_per_class: int, seed: int = 0) -> Path:
    """The first ``per_class + val_per_class`` images of each class in ``archive`` (in a
    seeded random order), split into ``train/`` and ``val/`` in a zip at ``out``."""
    picked: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
    with tarfile.open(archive) as tf:
        for m in tf:
            parts = m.name.split("/")
            if m.isfile() and len(parts) >= 3 and parts[-2] in classes \
                    and parts[-3] == "train":
                f = tf.extractfile(m)
                assert f is not None
                picked[parts[-2]].append((parts[-1], f.read()))
    rng = random.Random(seed)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:  # JPEGs do not compress
        for cls in classes:
            files = sorted(picked[cls])
            if len(files) < per_class + val_per_class:
                raise SystemExit(f"{cls}: {len(files)} images, {per_class + val_per_class} needed")
            rng.shuffle(files)
            for i, (name, data) in enumerate(files[:per_class + val_per_class]):
                split = "train" if i < per_class else "val"
                zf.writestr(f"{split}/{cls}/{name}", data)
    return out


def star_table(archive: Path, out: Path, limit: int | None = None) -> Path:
    """The labelled reviews of an IMDb archive as ``text,label`` rows, the label the star
    band of the review's rating (``limit``: at most that many rows, for a quick try)."""
    rows: list[tuple[str, str]] = []
    with tarfile.open(archive) as tf:
        for m in tf:
            hit = _REVIEW.search(m.name)
            if not (m.isfile() and hit):
                continue
            f = tf.extractfile(m)
            assert f is not None
            text = f.read().decode("utf-8", "replace").replace("<br />", " ")
            rows.append((text, STARS[int(hit.group(2))]))
            if limit is not None and len(rows) >= limit:
                break
    with out.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    im = sub.add_parser("images", help="a few CIFAR-10 classes as an ImageFolder zip")
    im.add_argument("archive", type=Path)
    im.add_argument("out", type=Path)
    im.add_argument("--classes", default="cat,dog,horse")
    im.add_argument("--per-class", type=int, default=1500)
    im.add_argument("--val-per-class", type=int, default=300)
    st = sub.add_parser("stars", help="IMDb reviews labelled by star band, as a CSV")
    st.add_argument("archive", type=Path)
    st.add_argument("out", type=Path)
    st.add_argument("--limit", type=int, default=None)
    a = p.parse_args()
    if a.what == "images":
        image_subset(a.archive, a.out, a.classes.split(","), a.per_class, a.val_per_class)
    else:
        star_table(a.archive, a.out, a.limit)
    print(a.out)


if __name__ == "__main__":
    main()
