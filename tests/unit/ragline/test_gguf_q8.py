"""A GGUF model's weights rewritten as Q8_0 (recipe `gguf-q8_0`): ggml's block layouts read
as ggml reads them, Q8_0 rounded as ggml rounds it, the file around the weights unchanged,
and the store deriving it like any derived model."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from ragline.models import ModelStore, gguf_q8
from ragline.models.store import sha256_of
from support.gguf_files import (
    metadata_entries,
    random_blocks,
    reference_block,
    write_gguf,
)


@pytest.mark.parametrize(
    "kind", sorted(gguf_q8.BLOCKS), ids=lambda k: gguf_q8.TYPE_NAMES.get(k, "Q8_0")
)
def test_every_block_type_reads_as_ggml_reads_it(kind):
    block = gguf_q8.BLOCKS[kind]
    raw = random_blocks(kind, 6, np.random.default_rng(kind))
    got = gguf_q8.dequantize(kind, np.frombuffer(raw, np.uint8))
    want = [
        v
        for i in range(6)
        for v in reference_block(kind, raw[i * block.bytes : (i + 1) * block.bytes])
    ]
    np.testing.assert_allclose(got, np.array(want, dtype=np.float32), rtol=1e-5, atol=1e-8)


def test_q8_0_rounds_half_away_from_zero_with_the_block_maximum_at_127():
    values = np.zeros(64, dtype=np.float32)
    values[:4] = [127.0, 2.5, -2.5, 0.49]  # scale 1: the values themselves, rounded
    blocks = gguf_q8.quantize_q8_0(values).reshape(2, 34)
    assert np.frombuffer(blocks[0, :2].tobytes(), "<f2")[0] == 1.0
    assert list(blocks[0, 2:6].view(np.int8)) == [127, 3, -3, 0]
    assert not blocks[1].any()  # an all-zero block: scale 0, values 0


def _tensors(rng: np.random.Generator) -> list[tuple[str, tuple[int, ...], int, bytes]]:
    norm = rng.normal(size=64).astype("<f4").tobytes()
    return [
        ("norm.weight", (64,), gguf_q8.F32, norm),
        ("blk.0.attn_q.weight", (64, 3), gguf_q8.Q5_0, random_blocks(gguf_q8.Q5_0, 6, rng)),
        ("blk.0.ffn_down.weight", (256, 2), gguf_q8.Q4_K, random_blocks(gguf_q8.Q4_K, 2, rng)),
        ("output.weight", (256, 1), gguf_q8.Q6_K, random_blocks(gguf_q8.Q6_K, 1, rng)),
        ("blk.0.attn_v.weight", (32, 3), gguf_q8.Q8_0, random_blocks(gguf_q8.Q8_0, 3, rng)),
    ]


def _data(path: Path, layout: gguf_q8.Layout, tensor: gguf_q8.TensorInfo) -> np.ndarray:
    raw = np.fromfile(path, dtype=np.uint8)[layout.data_start + tensor.offset :]
    return raw[: gguf_q8.data_bytes(tensor)]


def test_a_rewritten_file_keeps_all_but_its_weights_and_holds_them_in_q8_0(tmp_path):
    source, target = tmp_path / "source.gguf", tmp_path / "q8.gguf"
    tensors = _tensors(np.random.default_rng(7))
    write_gguf(source, tensors, alignment=64)

    report = gguf_q8.to_q8_0(source, target)

    before, after = gguf_q8.read_layout(source), gguf_q8.read_layout(target)
    assert report["requantized"] == {"Q4_K": 1, "Q5_0": 1, "Q6_K": 1} and report["kept"] == 2
    assert after.version == 3 and after.alignment == 64
    assert (
        after.metadata.replace(
            metadata_entries(gguf_q8.FILE_TYPE_Q8_0)[-1], metadata_entries(15)[-1]
        )
        == before.metadata
    )  # the vocabulary and the rest byte for byte; the file type says Q8_0
    assert [(t.name, t.dims) for t in after.tensors] == [(t.name, t.dims) for t in before.tensors]
    assert [t.type for t in after.tensors] == [gguf_q8.F32] + [gguf_q8.Q8_0] * 4
    assert all(t.offset % 64 == 0 for t in after.tensors)
    for old, new in zip(before.tensors, after.tensors, strict=True):
        if old.type in (gguf_q8.F32, gguf_q8.Q8_0):  # kept as they were
            assert _data(target, after, new).tobytes() == _data(source, before, old).tobytes()
            continue
        weights = gguf_q8.dequantize(old.type, _data(source, before, old)).reshape(-1, 32)
        q8 = gguf_q8.dequantize(gguf_q8.Q8_0, _data(target, after, new)).reshape(-1, 32)
        # Within half a Q8_0 step of every weight (the step: the block's largest / 127),
        # with the fp16 scale's own rounding.
        step = np.abs(weights).max(axis=1, keepdims=True) / 127
        assert np.all(np.abs(q8 - weights) <= step * 0.5 + np.abs(weights) * 2e-3 + 1e-12)


def test_a_weight_q8_0_cannot_hold_is_refused_not_written(tmp_path):
    source = tmp_path / "source.gguf"
    broken = bytearray(random_blocks(gguf_q8.Q5_0, 2, np.random.default_rng(1)))
    broken[0:2] = np.array([np.inf], dtype="<f2").tobytes()  # a scale of infinity
    write_gguf(source, [("blk.0.attn_q.weight", (32, 2), gguf_q8.Q5_0, bytes(broken))])
    with pytest.raises(gguf_q8.GgufError, match=r"attn_q\.weight: weights that are not finite"):
        gguf_q8.to_q8_0(source, tmp_path / "q8.gguf")


def test_a_weight_type_it_cannot_read_is_named(tmp_path):
    source = tmp_path / "source.gguf"
    iq4_xs = 23
    write_gguf(source, [("blk.0.attn_q.weight", (256, 1), iq4_xs, bytes(136))])
    with pytest.raises(gguf_q8.GgufError, match=r"attn_q\.weight: ggml type 23 is not read"):
        gguf_q8.to_q8_0(source, tmp_path / "q8.gguf")


def test_what_is_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + struct.pack("<I", 3))
    with pytest.raises(gguf_q8.GgufError, match="is not a GGUF file"):
        gguf_q8.read_layout(path)


def _store_of_a_model_and_its_q8_0(tmp_path: Path) -> ModelStore:
    bundled = tmp_path / "manifest" / "bundled" / "lm"
    bundled.mkdir(parents=True)
    write_gguf(bundled / "model.gguf", _tensors(np.random.default_rng(3)))
    manifest = tmp_path / "manifest" / "manifest.toml"
    manifest.write_text(
        f"""
[models.lm]
kind = "gguf"
description = "a small language model"
licence = "test"
bundled = "bundled/lm"

[models.lm.files]
"model.gguf" = {{ path = "model.gguf", sha256 = "{sha256_of(bundled / "model.gguf")}" }}

[models.lm-q8]
kind = "gguf"
description = "lm, Q8_0"
licence = "test"
derived_from = "lm"
derive = "gguf-q8_0"
"""
    )
    return ModelStore(tmp_path / "store", manifest=manifest)


def test_the_store_derives_the_q8_0_model_and_records_how(tmp_path):
    store = _store_of_a_model_and_its_q8_0(tmp_path)
    store.prepare("lm-q8")
    path = store.gguf_file("lm-q8")
    assert {t.type for t in gguf_q8.read_layout(path).tensors} == {gguf_q8.F32, gguf_q8.Q8_0}
    sidecar = json.loads((path.parent / "export.json").read_text())
    assert sidecar["made_by"] == {"recipe": "gguf-q8_0", "revision": 1}
    assert sidecar["report"]["source"] == "lm"
    assert store.version("lm-q8") != store.version("lm")


def test_a_derived_model_once_made_is_served_without_its_source(tmp_path):
    """What an image bakes: the Q8_0 files alone, the source neither kept nor fetchable."""
    store = _store_of_a_model_and_its_q8_0(tmp_path)
    store.prepare("lm-q8")
    shutil.rmtree(store.directory("lm"))
    (tmp_path / "manifest" / "bundled" / "lm" / "model.gguf").unlink()
    store.prepare("lm-q8")
    store.verify("lm-q8")
