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
from support.encoder_graph import encoder_graph
from support.tokenizers import CORPUS, byte_level_tokenizer


@pytest.fixture
def store(tmp_path) -> ModelStore:
    """A manifest of four models: a bundled source encoder and its static, dynamic and
    smoothed dynamic int8 derivatives."""
    source = tmp_path / "manifest" / "bundled" / "encoder"
    source.mkdir(parents=True)
    encoder_graph(source / "model.onnx")
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

[models.encoder-sq]
kind = "onnx-embedding"
description = "encoder, smoothed dynamic int8"
licence = "test"
derived_from = "encoder"
derive = "smoothed-dynamic-int8"
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


def _prepared(store: ModelStore, name: str):
    """Prepares and verifies `name`; its model file, graph and derivation report."""
    import onnx

    store.prepare(name)
    store.verify(name)
    derived = store.file(name, "model.onnx")
    report = json.loads((derived.parent / "export.json").read_text())["report"]
    return derived, onnx.load(str(derived)).graph, report


def _assert_close_to_source_run_alone(store: ModelStore, derived: Path) -> None:
    """Each text run alone (as the services run a graph that is not batch invariant) keeps
    every token row close to the source's."""
    source = _run(store.file("encoder", "model.onnx"), store, CORPUS[:3])
    for text, reference in zip(CORPUS[:3], source, strict=True):
        (ours,) = _run(derived, store, [text])
        cosine = np.sum(ours * reference, axis=1) / (
            np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
        )
        assert cosine.min() > 0.95


def test_the_derived_graph_is_int8_keeps_the_gelu_output_in_fp32_and_is_verified(store):
    derived, graph, report = _prepared(store, "encoder-qdq")
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
    derived, graph, report = _prepared(store, "encoder-dyn")
    ops = [n.op_type for n in graph.node]
    # Both weight MatMuls (the GELU-fed one too) run on int8 weights and per-run scales.
    assert ops.count("MatMulInteger") == 2 and "MatMul" not in ops
    assert "DynamicQuantizeLinear" in ops and "QuantizeLinear" not in ops
    assert report["recipe"] == "dynamic-int8" and report["held_out_texts_per_run"] == 1
    assert report["token_cosine_mean"] >= derive_module.MIN_TOKEN_COSINE
    _assert_close_to_source_run_alone(store, derived)


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


def test_the_smoothed_graph_is_dynamic_int8_behind_its_smoothing_and_is_verified(store):
    derived, graph, report = _prepared(store, "encoder-sq")
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulInteger") == 2 and "MatMul" not in ops
    # Each quantized MatMul reads its input through its smoothing Mul.
    producers = {o: n for n in graph.node for o in n.output}
    quantizers = [producers[n.input[0]] for n in graph.node if n.op_type == "MatMulInteger"]
    assert {q.op_type for q in quantizers} == {"DynamicQuantizeLinear"}
    assert all(producers[q.input[0]].name.endswith("/smooth") for q in quantizers)
    assert report["recipe"] == "smoothed-dynamic-int8" and report["held_out_texts_per_run"] == 1
    assert report["smoothing_alpha"] == derive_module.SMOOTHING_ALPHA
    assert report["smoothed_inputs"] == 2
    assert report["channel_spread_after"] < report["channel_spread_before"]
    assert report["token_cosine_mean"] >= derive_module.MIN_TOKEN_COSINE
    _assert_close_to_source_run_alone(store, derived)


def test_the_smoothed_graph_is_the_same_model_version_on_every_make(store, tmp_path):
    """Calibrated, yet reproducible: the channel maxima come from one deterministic fp32
    pass, so the same machine (and ONNX Runtime) makes the same bytes."""
    store.prepare("encoder-sq")
    again = ModelStore(tmp_path / "other-store", manifest=store.manifest)
    again.prepare("encoder-sq")
    assert store.version("encoder-sq") == again.version("encoder-sq")


def test_a_model_derived_by_an_older_recipe_revision_is_refused_then_derived_again(
    store, monkeypatch
):
    """A store keeps derived files across upgrades; a recipe whose output changed raises its
    revision, and files of the older one must not pass as the new model."""
    store.prepare("encoder-dyn")
    sidecar = store.directory("encoder-dyn") / "export.json"
    assert json.loads(sidecar.read_text())["made_by"] == {"recipe": "dynamic-int8", "revision": 1}
    recipe = derive_module.RECIPES["dynamic-int8"]
    newer = derive_module.Recipe(recipe.make, revision=recipe.revision + 1)
    monkeypatch.setitem(derive_module.RECIPES, "dynamic-int8", newer)
    with pytest.raises(
        ModelError, match="revision 1; this ragline derives it by dynamic-int8 revision 2"
    ):
        store.verify("encoder-dyn")
    store.prepare("encoder-dyn")
    store.verify("encoder-dyn")
    assert json.loads(sidecar.read_text())["made_by"]["revision"] == 2


def test_files_derived_before_revisions_were_recorded_count_as_revision_1(store, monkeypatch):
    store.prepare("encoder-dyn")
    sidecar = store.directory("encoder-dyn") / "export.json"
    recorded = json.loads(sidecar.read_text())
    del recorded["made_by"]
    sidecar.write_text(json.dumps(recorded))
    store.verify("encoder-dyn")
    recipe = derive_module.RECIPES["dynamic-int8"]
    monkeypatch.setitem(derive_module.RECIPES, "dynamic-int8", derive_module.Recipe(recipe.make, 2))
    assert not store.is_ready("encoder-dyn")
