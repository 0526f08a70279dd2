"""The one-pass tar reader shared by the CIFAR and IMDb loaders."""

from __future__ import annotations

import io
import logging
import tarfile
from pathlib import Path

import pytest

from vit_service.data import archive as archive_mod


def _tarfile_listing(path: Path) -> list[tuple[str, bytes]]:
    out = []
    with tarfile.open(path, "r:*") as tf:
        for m in tf:
            if m.isfile():
                f = tf.extractfile(m)
                out.append((m.name, f.read() if f else b""))
    return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_fast_tar_reader_matches_tarfile(tmp_path, fmt) -> None:
    names = ["a/b/short.jpg", "x" * 90 + "/" + "y" * 60 + "/long.png", "a/empty.txt"]
    if fmt != tarfile.USTAR_FORMAT:
        names.append("z" * 120 + "/" + "w" * 150 + "/very_long_ünïcode.jpg")
    archive = tmp_path / "t.tar.gz"
    with tarfile.open(archive, "w:gz", format=fmt) as tf:
        for i, name in enumerate(names):
            data = bytes(range(256)) * i
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        d = tarfile.TarInfo("a/dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
    got = list(archive_mod.iter_tar_files(archive))
    assert got == _tarfile_listing(archive)
    assert [n for n, _ in got] == names
    only_jpg = list(archive_mod.iter_tar_files(archive, lambda n: n.endswith(".jpg")))
    assert [d is not None for _, d in only_jpg] == [n.endswith(".jpg") for n in names]


def test_tar_reader_falls_back_to_tarfile(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=archive_mod.__name__)
    archive = tmp_path / "odd.tar"
    with tarfile.open(archive, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, kind in (
            ("c/1.jpg", tarfile.REGTYPE),
            ("vol", b"V"),
            ("c/2.jpg", tarfile.REGTYPE),
        ):
            info = tarfile.TarInfo(name)
            info.type = kind
            data = name.encode() * 3
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    got = list(archive_mod.iter_tar_files(archive))
    assert got == _tarfile_listing(archive)
    assert [n for n, _ in got] == ["c/1.jpg", "c/2.jpg"]
    assert "continuing with tarfile" in caplog.text
