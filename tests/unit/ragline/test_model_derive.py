"""Models derived at prepare time: the int8 recipes on a small real ONNX graph (a
weights-only int8 encoder with an erf GELU, the shape of the real one), and the store's
handling of what a recipe makes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ragline.models import ModelError, ModelStore
from ragline.models import derive as derive_module
from support.tokenizers import CORPUS, byte_level_tokenizer

WIDTH, VOCAB = 32, 512


def _encoder_graph(path: Path) -> None:
    """input_ids -> embedding -> int8-weight MatMul (Cast * scale, as the shipped graph
    stores it) -> erf GELU -> MatMul -> masked last_hidden_state [batch, seq, WIDTH]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    table = rng.normal(size=(VOCAB, WIDTH)).astype(np.float32)
    up_int8 = rng.integers(-127, 128, size=(WIDTH, 4 * WIDTH)).astype(np.int8)
    down = (rng.normal(size=(4 * WIDTH, WIDTH)) / 8).astype(np.float32)
    consts = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(up_int8, "up_int8"),
        numpy_helper.from_array(np.array(0.01, np.float32), "up_scale"),
        numpy_helper.from_array(down, "down"),
        numpy_helper.from_array(np.array(1.4142135, np.float32), "sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["embedded"]),
        helper.make_node("Cast", ["up_int8"], ["up_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["up_f", "up_scale"], ["up"]),
        helper.make_node("MatMul", ["embedded", "up"], ["hidden"]),
        helper.make_node("Div", ["hidden", "sqrt2"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["erf1"]),
        helper.make_node("Mul", ["hidden", "erf1"], ["gelu_x"]),
        helper.make_node("Mul", ["gelu_x", "half"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "down"], ["projected"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask3"]),
        helper.make_node("Mul", ["projected", "mask3"], ["last_hidden_state"]),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [
            helper.make_tensor_value_info(
                "last_hidden_state", TensorProto.FLOAT, ["batch", "seq", WIDTH]
            )
        ],
        consts,
    )
    for index, node in enumerate(graph.node):  # exporters name every node
        node.name = f"{node.op_type}_{index}"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.fixture
def store(tmp_path) -> ModelStore:
    """A manifest of three models: a bundled source encoder and its static and dynamic int8
    derivatives."""
    source = tmp_path / "manifest" / "bundled" / "encoder"
    source.mkdir(parents=True)
    _encoder_graph(source / "model.onnx")
    byte_level_tokenizer(source)
    calibration = tmp_path / "manifest" / "calibration"
    calibration.mkdir()
    texts = sorted(set(CORPUS))
    (calibration / "texts.json").write_text(
        json.dumps({"calibrate": texts * 4, "held_out": [t[::-1] for t in texts]})
    )
    sha = {name: _sha(source / name) for name in ("model.onnx", "tokenizer.json")}
    manifest = tmp_path / "manifest" / "manifest.toml"
    manifest.write_text(
        f"""
[models.encoder]
kind = "onnx-embedding"
description = "a small encoder"
licence = "test"
bundled = "bundled/encoder"
output = "last_hidden_state"
max_tokens = 64

[models.encoder.files]
"model.onnx" = {{ path = "model.onnx", sha256 = "{sha["model.onnx"]}" }}
"tokenizer.json" = {{ path = "tokenizer.json", sha256 = "{sha["tokenizer.json"]}" }}

[models.encoder-qdq]
kind = "onnx-embedding"
description = "encoder, static int8"
licence = "test"
derived_from = "encoder"
derive = "static-int8-qdq"
calibration = "calibration/texts.json"
output = "last_hidden_state"
tokenizer = "encoder"
max_tokens = 64

[models.encoder-dyn]
kind = "onnx-embedding"
description = "encoder, dynamic int8"
licence = "test"
derived_from = "encoder"
derive = "dynamic-int8"
calibration = "calibration/texts.json"
batch_invariant = false
output = "last_hidden_state"
tokenizer = "encoder"
max_tokens = 64
"""
    )
    return ModelStore(tmp_path / "store", manifest=manifest)


def _sha(path: Path) -> str:
    from ragline.models.store import sha256_of

    return sha256_of(path)


def _run(path: Path, store: ModelStore, texts: list[str]) -> list[np.ndarray]:
    """Each text's token rows, the texts run together in one padded batch."""
    import onnxruntime as ort

    from ragline.batching import pad
    from ragline.tokenization import Tokenizer

    tokenizer = Tokenizer(store.file("encoder", "tokenizer.json"), 64)
    encoded = tokenizer.encode(texts, refuse_over_limit=False)
    ids, mask = pad(encoded)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask})
    return [hidden[i, : t.length] for i, t in enumerate(encoded)]


def test_the_derived_graph_is_int8_keeps_the_gelu_output_in_fp32_and_is_verified(store):
    import onnx

    store.prepare("encoder-qdq")
    store.verify("encoder-qdq")
    derived = store.file("encoder-qdq", "model.onnx")
    graph = onnx.load(str(derived)).graph
    ops = [n.op_type for n in graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    assert "Cast" not in {n.op_type for n in graph.node if "up_int8" in n.input}  # folded
    producers = {o: n for n in graph.node for o in n.output}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    # The feed-forward output (fed by the GELU) reads its fp32 weight directly; the other
    # MatMul reads a dequantized int8 weight.
    weight_ops = sorted(
        producers[m.input[1]].op_type if m.input[1] in producers else "initializer" for m in matmuls
    )
    assert weight_ops == ["DequantizeLinear", "initializer"]
    report = json.loads((derived.parent / "export.json").read_text())["report"]
    assert report["token_cosine_mean"] >= derive_module.MIN_TOKEN_COSINE
    assert report["source"] == "encoder" and report["recipe"] == "static-int8-qdq"
    source = _run(store.file("encoder", "model.onnx"), store, CORPUS[:3])
    ours = _run(derived, store, CORPUS[:3])
    for a, b in zip(source, ours, strict=True):
        cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert cosine.min() > 0.95


def test_a_texts_vectors_do_not_depend_on_its_batch(store):
    store.prepare("encoder-qdq")
    derived = store.file("encoder-qdq", "model.onnx")
    short, long = CORPUS[3], CORPUS[1] * 3
    alone = _run(derived, store, [short])[0]
    batched = _run(derived, store, [short, long])[0]
    np.testing.assert_array_equal(alone, batched)


def test_a_derived_model_below_the_quality_floor_is_refused_and_not_kept(store, monkeypatch):
    monkeypatch.setattr(derive_module, "MIN_TOKEN_COSINE", 1.01)
    with pytest.raises(ModelError, match=r"below 1\.01"):
        store.prepare("encoder-qdq")
    assert not store.directory("encoder-qdq").exists()
    assert not store.is_ready("encoder-qdq")


def test_a_changed_derived_file_fails_verification(store):
    store.prepare("encoder-qdq")
    path = store.file("encoder-qdq", "model.onnx")
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ModelError, match="sha256"):
        store.verify("encoder-qdq")


def test_an_unknown_recipe_is_named(store, monkeypatch):
    monkeypatch.setattr(derive_module, "RECIPES", {})
    with pytest.raises(ModelError, match="unknown recipe 'static-int8-qdq'"):
        store.prepare("encoder-qdq")


def test_the_dynamic_graph_quantizes_every_weight_matmul_and_is_verified(store):
    import onnx

    store.prepare("encoder-dyn")
    store.verify("encoder-dyn")
    derived = store.file("encoder-dyn", "model.onnx")
    ops = [n.op_type for n in onnx.load(str(derived)).graph.node]
    # Both weight MatMuls (the GELU-fed one too) run on int8 weights and per-run scales.
    assert ops.count("MatMulInteger") == 2 and "MatMul" not in ops
    assert "DynamicQuantizeLinear" in ops and "QuantizeLinear" not in ops
    report = json.loads((derived.parent / "export.json").read_text())["report"]
    assert report["recipe"] == "dynamic-int8" and report["held_out_texts_per_run"] == 1
    assert report["token_cosine_mean"] >= derive_module.MIN_TOKEN_COSINE
    source = _run(store.file("encoder", "model.onnx"), store, CORPUS[:3])
    for text, reference in zip(CORPUS[:3], source, strict=True):
        (ours,) = _run(derived, store, [text])  # alone, as the services run it
        cosine = np.sum(ours * reference, axis=1) / (
            np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
        )
        assert cosine.min() > 0.95


def test_the_dynamic_graph_is_the_same_bytes_on_every_make(store, tmp_path):
    """Weights only: nothing measured goes into the file, so every machine with the same
    ONNX Runtime makes the same model version (and so the same index)."""
    store.prepare("encoder-dyn")
    again = ModelStore(tmp_path / "other-store", manifest=store.manifest)
    again.prepare("encoder-dyn")
    assert store.version("encoder-dyn") == again.version("encoder-dyn")


def test_the_dynamic_graph_depends_on_its_batch_so_it_is_run_alone(store):
    """Why the manifest marks it `batch_invariant = false`: a text's rows change when a
    text with larger activations shares its run."""
    from ragline.embedder import batch_invariant

    assert not batch_invariant(store.spec("encoder-dyn"))
    assert batch_invariant(store.spec("encoder-qdq"))
    store.prepare("encoder-dyn")
    derived = store.file("encoder-dyn", "model.onnx")
    short, long = CORPUS[3], CORPUS[1] * 3
    alone = _run(derived, store, [short])[0]
    np.testing.assert_array_equal(alone, _run(derived, store, [short])[0])
    batched = _run(derived, store, [short, long])[0]
    assert np.abs(alone - batched).max() > 0
