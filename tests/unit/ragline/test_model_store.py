"""A model committed beside the manifest (`bundled`, the reranker ragline trains) is copied
into the store only with the sha256 the manifest pins."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ragline.models import ModelError, ModelStore

WEIGHTS = b"int8 weights"


def _store(tmp_path: Path, pinned: bytes) -> ModelStore:
    bundled = tmp_path / "bundled" / "tiny-ce"
    bundled.mkdir(parents=True)
    (bundled / "model.onnx").write_bytes(WEIGHTS)
    sha = hashlib.sha256(pinned).hexdigest()
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(
        '[models.tiny-ce]\nkind = "onnx-cross-encoder"\ndescription = "a test model"\n'
        'licence = "test"\nbundled = "bundled/tiny-ce"\n\n'
        f'[models.tiny-ce.files]\n"model.onnx" = {{ path = "model.onnx", sha256 = "{sha}" }}\n'
    )
    return ModelStore(tmp_path / "store", manifest=manifest)


def test_a_bundled_model_with_its_pinned_sha256_is_prepared(tmp_path: Path) -> None:
    directory = _store(tmp_path, pinned=WEIGHTS).prepare("tiny-ce", log=lambda _: None)
    assert (directory / "model.onnx").read_bytes() == WEIGHTS


def test_a_bundled_model_that_changed_is_refused_with_the_file_named(tmp_path: Path) -> None:
    store = _store(tmp_path, pinned=b"the weights that were committed")
    with pytest.raises(
        ModelError, match=r"bundled .*tiny-ce/model.onnx has sha256 .*manifest pins"
    ):
        store.prepare("tiny-ce", log=lambda _: None)
    assert not store.directory("tiny-ce").exists()
