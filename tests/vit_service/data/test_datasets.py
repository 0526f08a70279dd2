"""Uploaded data sets: real archives and tables built here, checked and stored."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_service.data.datasets import DatasetStore
from vit_service.data.upload_checks import DatasetError, DatasetLimits, label_name

LIMITS = DatasetLimits(min_per_class=3)


def png(seed: int, size: tuple[int, int] = (12, 10)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def tree(prefix: str = "", classes: tuple[str, ...] = ("cat", "dog"), n: int = 4,
         val: int = 0) -> dict[str, bytes]:
    out = {}
    for k, c in enumerate(classes):
        for i in range(n):
            out[f"{prefix}train/{c}/{i}.png" if val else f"{prefix}{c}/{i}.png"] = png(k * 100 + i)
        for i in range(val):
            out[f"{prefix}val/{c}/{i}.png"] = png(k * 100 + 50 + i)
    return out


@pytest.fixture
def store(tmp_path: Path) -> DatasetStore:
    return DatasetStore(tmp_path / "datasets", LIMITS)


def upload(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / f"upload-{name}"
    p.write_bytes(data)
    return p


def test_an_image_folder_zip_with_a_val_split(store: DatasetStore, tmp_path: Path) -> None:
    z = image_zip(tmp_path / "pets.zip", tree("pets/", val=2))
    data = z.read_bytes()
    info, new = store.add(upload(tmp_path, "a", data), "pets.zip")
    assert new and info.kind == "image" and info.format == "zip"
    assert info.classes == ["cat", "dog"]
    assert info.counts == {"train": {"cat": 4, "dog": 4}, "val": {"cat": 2, "dog": 2}}
    assert info.stats["width"]["max"] == 12 and info.stats["height"]["min"] == 10
    assert store.data_path(info.id).read_bytes() == data
    again, new = store.add(upload(tmp_path, "b", data), "copy.zip")  # same bytes, same id
    assert not new and again.id == info.id and [d.id for d in store.list()] == [info.id]


def test_a_tar_gz_tree_without_splits(store: DatasetStore, tmp_path: Path) -> None:
    p = tmp_path / "t.tar.gz"
    with tarfile.open(p, "w:gz") as tf:
        for name, data in tree("root/", classes=("a", "b", "c")).items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    info, _ = store.add(upload(tmp_path, "t", p.read_bytes()), "t.tar.gz")
    assert info.format == "tar.gz" and info.classes == ["a", "b", "c"]
    assert info.counts == {"train": {"a": 4, "b": 4, "c": 4}}


@pytest.mark.parametrize(("members", "message"), [
    ({**tree(), "cat/bad.png": b"\x89PNG\r\n\x1a\nnot really"}, "cat/bad.png"),
    ({**tree(), "../evil/x.png": png(1)}, "'..'"),
    ({**tree(), "/etc/x.png": png(1)}, "absolute"),
    ({**tree(), "dog/bomb.png": b"\0" * 5_000_000}, "zip bomb"),
    (tree(classes=("cat",)), "at least 2"),
    (tree(n=2), "at least 3 examples per class"),
    ({**tree(), "loose.png": png(3)}, "not inside a class folder"),
])
def test_bad_archives_are_refused_and_leave_nothing(store: DatasetStore, tmp_path: Path,
                                                    members: dict[str, bytes],
                                                    message: str) -> None:
    z = image_zip(tmp_path / "x.zip", members)
    up = upload(tmp_path, "x", z.read_bytes())
    with pytest.raises(DatasetError, match=message):
        store.add(up, "x.zip")
    assert not up.exists()
    assert not store.root.exists() or not any(store.root.iterdir())


def _patch_central(data: bytes, member: str, flags: int = 0, method: int | None = None,
                   name_byte: tuple[int, int] | None = None) -> bytes:
    """``data`` (a zip) with ``member``'s central directory entry changed: flag bits set, the
    compression method replaced, one byte of its name replaced (what zipfile reads)."""
    z = bytearray(data)
    i = z.index(b"PK\x01\x02")  # the first central directory entry
    while True:
        n = int.from_bytes(z[i + 28:i + 30], "little")
        if z[i + 46:i + 46 + n] == member.encode():
            break
        extra, comment = (int.from_bytes(z[i + k:i + k + 2], "little") for k in (30, 32))
        i = z.index(b"PK\x01\x02", i + 46 + n + extra + comment)
    z[i + 8:i + 10] = (int.from_bytes(z[i + 8:i + 10], "little") | flags).to_bytes(2, "little")
    if method is not None:
        z[i + 10:i + 12] = method.to_bytes(2, "little")
    if name_byte is not None:
        z[i + 46 + name_byte[0]] = name_byte[1]
    return bytes(z)


@pytest.mark.parametrize(("patch", "message"), [
    ({"method": 97}, "cannot be read"),  # a compression method zipfile does not know
    ({"flags": 0x1}, "cannot be read"),  # encrypted
    ({"corrupt": True}, "cannot be read"),  # a deflate stream that is not one (zlib.error)
    ({"flags": 0x800, "name_byte": (4, 0xFF)}, "not a readable zip"),  # "UTF-8" name that is not
])
def test_zip_members_zipfile_cannot_read_are_refused(store: DatasetStore, tmp_path: Path,
                                                     patch: dict, message: str) -> None:
    data = image_zip(tmp_path / "x.zip", tree()).read_bytes()
    if patch.pop("corrupt", False):  # the first member's deflated bytes, scrambled
        z = bytearray(data)
        start = 30 + int.from_bytes(z[26:28], "little") + int.from_bytes(z[28:30], "little")
        z[start:start + 16] = bytes(range(0xF0, 0x100))
        data = bytes(z)
    else:
        data = _patch_central(data, "cat/0.png", **patch)
    with pytest.raises(DatasetError, match=message):
        store.add(upload(tmp_path, "x", data), "x.zip")
    assert not store.root.exists() or not any(store.root.iterdir())


def test_member_names_that_cannot_be_kept_are_refused(store: DatasetStore,
                                                       tmp_path: Path) -> None:
    long = image_zip(tmp_path / "l.zip", {**tree(), f"cat/{'a' * 252}.png": png(9)})
    with pytest.raises(DatasetError, match="longer than 200 bytes"):
        store.add(upload(tmp_path, "l", long.read_bytes()), "l.zip")
    # a class folder whose name is not UTF-8 (read back with a lone surrogate): refused, not
    # kept (it would be a class name that no JSON answer can carry)
    p = tmp_path / "t.tar.gz"
    with tarfile.open(p, "w:gz", encoding="latin-1", format=tarfile.GNU_FORMAT) as tf:
        for name, data in {**tree(), **{f"caf\xe9/{i}.png": png(i) for i in range(4)}}.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    with pytest.raises(DatasetError, match="not valid Unicode"):
        store.add(upload(tmp_path, "t", p.read_bytes()), "t.tar.gz")
    assert not store.root.exists() or not any(store.root.iterdir())


def test_a_csv_table(store: DatasetStore, tmp_path: Path) -> None:
    rows = ["text,label"] + [f'"review {i}, with a comma",{("pos", "neg")[i % 2]}'
                             for i in range(8)]
    info, _ = store.add(upload(tmp_path, "c", "\n".join(rows).encode()), "reviews.csv")
    assert info.kind == "text" and info.format == "csv"
    assert info.counts == {"train": {"neg": 4, "pos": 4}} and info.stats["words"]["max"] == 5


@pytest.mark.parametrize("name", ["r.csv", "r.jsonl"])
def test_a_table_with_a_byte_order_mark_is_read_alike_at_upload_and_in_training(
        store: DatasetStore, tmp_path: Path, name: str) -> None:
    pairs = [(f"review {i}", ("pos", "neg")[i % 2]) for i in range(8)]
    lines = (["text,label"] + [f"{t},{c}" for t, c in pairs] if name.endswith(".csv")
             else [json.dumps({"text": t, "label": c}) for t, c in pairs])
    info, _ = store.add(upload(tmp_path, "c", "\n".join(lines).encode("utf-8-sig")), name)
    assert info.counts == {"train": {"neg": 4, "pos": 4}}
    table = store.text_table(info.id)  # what a training run reads
    assert table.texts == [t for t, _ in pairs]
    assert [table.class_names[k] for k in table.labels] == [c for _, c in pairs]


def test_a_jsonl_table_with_numeric_labels(store: DatasetStore, tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"t {i}", "label": i % 3}) for i in range(9)]
    info, _ = store.add(upload(tmp_path, "j", "\n".join(lines).encode()), "r.jsonl")
    assert info.classes == ["0", "1", "2"]


def test_a_json_number_names_one_class_however_it_is_written(
        store: DatasetStore, tmp_path: Path) -> None:
    labels = [1, 1.0, 0, -0.0, 0.0, 2.5, 1, 0, 2.5, 2.5]
    lines = [json.dumps({"text": f"t {i}", "label": v}) for i, v in enumerate(labels)]
    info, _ = store.add(upload(tmp_path, "j", "\n".join(lines).encode()), "r.jsonl")
    assert info.counts == {"train": {"0": 4, "1": 3, "2.5": 3}}
    table = store.text_table(info.id)  # training reads the same classes
    assert [table.class_names[k] for k in table.labels] == [label_name(v) for v in labels]
    assert label_name(1.0) == "1" and label_name(2.5) == "2.5" and label_name(True) == "True"


def test_a_csv_label_is_text_as_written(store: DatasetStore, tmp_path: Path) -> None:
    rows = ["text,label"] + [f"t {i},{v}" for i, v in enumerate(["1", "1.0"] * 3)]
    info, _ = store.add(upload(tmp_path, "c", "\n".join(rows).encode()), "r.csv")
    assert info.classes == ["1", "1.0"]


@pytest.mark.parametrize(("name", "body", "message"), [
    ("r.csv", "review,label\nhello,pos\n", "line 1: the header lacks the column"),
    ("r.csv", "text,label\n" + "good,pos\n" * 5, "1 class"),
    ("r.jsonl", '{"text": "a", "label": 1}\n{"text": "b"\n', "line 2: not JSON"),
    ("r.jsonl", '{"text": "a", "label": 1}\n{"text": "", "label": 2}\n', "line 2: 'text'"),
    ("r.csv", "text,label\nok,\n", "line 2: 'label'"),
    ("notes.txt", "hello", "expected an ImageFolder"),
    ("r.csv", 'text,label\n"unclosed,pos\nb,neg\n', "not a readable CSV"),
    ("r.jsonl", '{"text": "a", "label": "\\ud800"}\n', "line 1: 'label' is not valid Unicode"),
    ("r.jsonl", '{"text": "a \\udc00", "label": 1}\n', "line 1: 'text' is not valid Unicode"),
    ("r.jsonl", '{"text": "a", "label": NaN}\n', "line 1: 'label' must be"),
    ("r.jsonl", '{"text": "a", "label": ' + "1" * 5000 + "}\n", "line 1: not a usable JSON"),
    ("r.jsonl", "[" * 100_000 + "\n", "line 1: not"),
])
def test_bad_tables_name_the_line(store: DatasetStore, tmp_path: Path, name: str, body: str,
                                  message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        store.add(upload(tmp_path, "t", body.encode()), name)
    assert not store.root.exists() or not any(store.root.iterdir())


def test_delete_and_unknown_ids(store: DatasetStore, tmp_path: Path) -> None:
    z = image_zip(tmp_path / "p.zip", tree())
    info, _ = store.add(upload(tmp_path, "p", z.read_bytes()), "p.zip")
    store.delete(info.id)
    assert store.list() == []
    for bad in (info.id, "../../etc", "0" * 15, "G" * 16):
        with pytest.raises(KeyError):
            store.get(bad)
