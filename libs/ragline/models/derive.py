"""Models made at prepare time from another model of the manifest, with ONNX Runtime or numpy
alone (no torch): a fresh machine, a CI runner and the container build all make them the same
way.

Recipe `gguf-q8_0`: a GGUF generation model with its quantized weights rewritten as Q8_0,
the weight type llama.cpp's fastest CPU kernels read (ragline.models.gguf_q8).

Every ONNX recipe starts from the source graph's weights folded to fp32 constants (ONNX
Runtime's basic optimizations: a weights-only int8 graph dequantizes every weight on every
run), and compares the result with its source on the manifest's held-out text before it is
kept (refused below `MIN_TOKEN_COSINE`).

Recipe `static-int8-qdq`: static QDQ int8: per-channel int8 weights, activation scales
calibrated once on the manifest's calibration text and then fixed, so a text's vectors never
depend on its batch.

Recipe `dynamic-int8`: ONNX Runtime's dynamic quantization of the weight MatMuls: per-channel
int8 weights (a pure function of the weights: the same bytes wherever the same ONNX Runtime
makes them), activations quantized at run time with scales taken from the run's own input.
A text's vectors then depend on what shares its run, so such a model is run one text at a
time (`batch_invariant = false`); alone, it is faster per text than the static graph batched
(MiniLM-L6 on one thread: 2.8-3.2 ms per question against 3.7-4.7 at 1-32 per run).

Recipe `smoothed-dynamic-int8`: the dynamic recipe after activation smoothing
(`ragline.models.smoothing`, calibrated on the manifest's calibration text): same speed and
run rule, and the int8 activation error that cost the dynamic graph 0.003 nDCG@10 of vector
search against its source is gone (MiniLM-L6, exact search: SQuAD dev 0.7692 -> 0.7719,
new_wiki 0.7739 -> 0.7780; source 0.7724 / 0.7768).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ragline.models.store import Log, ModelSpec, ModelStore
    from ragline.tokenization import Tokenizer

# What a recipe reports, kept beside the model (export.json).
Report = dict[str, Any]
Feed = dict[str, np.ndarray]


@dataclass(frozen=True)
class QuantizeJob:
    """What a recipe's quantizing step works on; it writes `target`."""

    folded: Path  # the source graph, its weights folded to constants
    target: Path
    tokenizer: Tokenizer
    calibration: dict[str, Any]  # the manifest's calibration file
    inputs: set[str]  # the graph's input names


# A recipe's quantizing step: the facts it reports.
Quantize = Callable[[QuantizeJob], Report]

# Per-token cosine to the source graph, mean over held-out text (measured for the
# MiniLM-L6 graph: 0.984 mean, 0.946 min over the 96 held-out texts).
MIN_TOKEN_COSINE = 0.97
CALIBRATION_BATCH = 16
# SmoothQuant's migration strength. Chosen on the held-out calibration text alone (MiniLM-L6,
# one text per run, mean cosine of sentence vectors to the source's, whole leads / their
# first 6-14 words): unsmoothed 0.9953 / 0.9945; alpha 0.5 0.9875 / 0.9868, 0.6 0.9963 /
# 0.9959, 0.7 0.9982 / 0.9980, 0.75 0.9983 / 0.9982, 0.8 0.9983 / 0.9982, 0.85 0.9972 /
# 0.9971, 0.9 0.9982 / 0.9982, 1.0 0.9980 / 0.9978. 0.75 is the middle of the 0.7-0.8
# plateau; the retrieval sets validated it, they did not pick it.
SMOOTHING_ALPHA = 0.75


def _fold_weights(source: Path, target: Path) -> set[str]:
    """Writes the folded graph to `target`; returns the graph's input names."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Basic = constant folding and standard-op rewrites only: the result is still a plain
    # ONNX graph the quantizer can read.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(target)
    session = ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return {i.name for i in session.get_inputs()}


def calibration_feeds(
    tokenizer: Tokenizer, texts: list[str], input_names: set[str], batch: int = CALIBRATION_BATCH
) -> Iterator[Feed]:
    """Model feeds of `texts` in padded batches of `batch` (also for tools/export_onnx.py);
    token type ids (all zero) only where the graph takes them."""
    from ragline.batching import pad

    encoded = tokenizer.encode(texts, refuse_over_limit=False)
    for start in range(0, len(encoded), batch):
        ids, mask = pad(encoded[start : start + batch])
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        yield feeds


def _token_vectors(path: Path, feeds: list[Feed], output: str) -> np.ndarray:
    """Every real token's output vector (padding left out), in order."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = []
    for feed in feeds:
        (hidden,) = session.run([output], feed)
        rows.append(hidden[feed["attention_mask"].astype(bool)])
    return np.concatenate(rows)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.clip(np.linalg.norm(a, axis=1, keepdims=True), 1e-12, None)
    b = b / np.clip(np.linalg.norm(b, axis=1, keepdims=True), 1e-12, None)
    cosines: np.ndarray = np.sum(a * b, axis=1)
    return cosines


def _derived(
    store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log, quantize: Quantize
) -> Report:
    """The steps every recipe shares: fold the source's weights, `quantize(QuantizeJob(folded,
    target, tokenizer, calibration, input names))`, then compare the result with the source on the
    held-out text, each run holding as many texts as the services will run it with
    (`ragline.embedder.texts_per_run`: one for a model the manifest marks not batch
    invariant, whose activation scales come from its run).
    Writes `target_dir/model.onnx`; returns the report kept beside it."""
    import onnxruntime as ort

    from ragline.embedder import texts_per_run
    from ragline.models.store import ModelError
    from ragline.tokenization import Tokenizer

    source = store.file(spec.derived_from, "model.onnx")
    tokenizer = Tokenizer(store.file(spec.tokenizer, "tokenizer.json"), spec.max_tokens)
    calibration = json.loads((store.manifest.parent / spec.calibration).read_text())
    output = spec.output or "last_hidden_state"
    per_run = texts_per_run(spec, CALIBRATION_BATCH)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        folded = Path(tmp) / "folded.onnx"
        inputs = _fold_weights(source, folded)
        target = target_dir / "model.onnx"
        facts = quantize(QuantizeJob(folded, target, tokenizer, calibration, inputs))
        held_out = list(
            calibration_feeds(tokenizer, calibration["held_out"], inputs, batch=per_run)
        )
        cosine = _cosines(
            _token_vectors(target, held_out, output), _token_vectors(source, held_out, output)
        )
    report = {
        "recipe": spec.derive,
        "source": spec.derived_from,
        **facts,
        "held_out_texts": len(calibration["held_out"]),
        "held_out_texts_per_run": per_run,
        "token_cosine_min": round(float(cosine.min()), 6),
        "token_cosine_mean": round(float(cosine.mean()), 6),
        "seconds": round(time.monotonic() - started, 1),
        "onnxruntime": ort.__version__,
        "bytes": target.stat().st_size,
    }
    if report["token_cosine_mean"] < MIN_TOKEN_COSINE:
        raise ModelError(
            f"model {spec.name}: {spec.derive} graph's token cosine to {spec.derived_from} is "
            f"{report['token_cosine_mean']} on held-out text, below {MIN_TOKEN_COSINE}; "
            "not kept"
        )
    return report


def static_int8_qdq(store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log) -> Report:
    """Writes `target_dir/model.onnx`; returns the report kept beside it."""
    from ragline.models.quantization import quantize_static_qdq

    def quantize(job: QuantizeJob) -> Report:
        texts = job.calibration["calibrate"]
        log(f"calibrating {spec.name} on {len(texts)} texts")
        quantize_static_qdq(
            job.folded,
            job.target,
            calibration_feeds(job.tokenizer, texts, job.inputs),
            op_types=("MatMul",),
            # Measured on MiniLM-L6 (cosine to fp32, min / mean): every weight MatMul
            # 0.877 / 0.925; leaving the feed-forward outputs (fed by GELU, outlier
            # activations) in fp32 0.986 / 0.991.
            weights_only_matmuls=True,
            keep_fp32_after_gelu=True,
        )
        return {"calibration": f"{spec.calibration}: {len(texts)} texts"}

    return _derived(store, spec, target_dir, log, quantize)


def dynamic_int8(store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log) -> Report:
    """Writes `target_dir/model.onnx`; returns the report kept beside it."""
    from ragline.models.quantization import quantize_dynamic_int8

    def quantize(job: QuantizeJob) -> Report:
        log(f"quantizing {spec.name}'s weights")
        quantize_dynamic_int8(job.folded, job.target)
        return {}

    # Activation scales come from each run's own input: the manifest marks such a graph
    # `batch_invariant = false`, so it is held out one text per run, as the services run it.
    return _derived(store, spec, target_dir, log, quantize)


def smoothed_dynamic_int8(store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log) -> Report:
    """Writes `target_dir/model.onnx`; returns the report kept beside it."""
    from ragline.models.quantization import quantize_dynamic_int8
    from ragline.models.smoothing import smooth_activations

    def quantize(job: QuantizeJob) -> Report:
        texts = job.calibration["calibrate"]
        log(f"smoothing {spec.name}'s activations on {len(texts)} texts, then quantizing")
        with tempfile.TemporaryDirectory() as tmp:
            smoothed_path = Path(tmp) / "smoothed.onnx"
            smoothed = smooth_activations(
                job.folded,
                smoothed_path,
                calibration_feeds(job.tokenizer, texts, job.inputs),
                SMOOTHING_ALPHA,
            )
            quantize_dynamic_int8(smoothed_path, job.target)
        return {
            "calibration": f"{spec.calibration}: {len(texts)} texts",
            "smoothing_alpha": SMOOTHING_ALPHA,
            "smoothed_inputs": len(smoothed),
            # Largest channel max over the median one, worst smoothed input: what one int8
            # scale per tensor has to span.
            "channel_spread_before": round(max(s.spread_before for s in smoothed), 2),
            "channel_spread_after": round(max(s.spread_after for s in smoothed), 2),
        }

    return _derived(store, spec, target_dir, log, quantize)


def e5_q4_onnx(store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log) -> Report:
    from ragline.models import e5_q4

    return e5_q4.derive(store, spec, target_dir, log)


def gguf_q8_0(store: ModelStore, spec: ModelSpec, target_dir: Path, log: Log) -> Report:
    """Writes `target_dir/model.gguf`: the source GGUF with its quantized weights in Q8_0
    (ragline.models.gguf_q8); returns the report kept beside it."""
    from ragline.models import gguf_q8

    source = store.gguf_file(spec.derived_from)
    log(f"rewriting {spec.derived_from}'s weights as Q8_0")
    return {"source": spec.derived_from, **gguf_q8.to_q8_0(source, target_dir / "model.gguf")}


@dataclass(frozen=True)
class Recipe:
    """`make(store, spec, target_dir, log)` writes the model's files into `target_dir` and
    returns the report kept beside them (export.json, with the revision)."""

    make: Callable[[ModelStore, ModelSpec, Path, Log], Report]
    # Raised whenever what the recipe writes from the same source changes (its graph, its
    # quantization): a store holding an older revision's files derives them again, and the
    # new files are a new model version (indexes built with the old one re-embed or refuse).
    revision: int


RECIPES = {
    # 2: ONNX Runtime's fused Gelu instead of erf spelled out in five nodes (1.12-1.15x per
    # thread, the same vectors).
    "e5-q4-onnx": Recipe(e5_q4_onnx, revision=2),
    "static-int8-qdq": Recipe(static_int8_qdq, revision=1),
    "dynamic-int8": Recipe(dynamic_int8, revision=1),
    "smoothed-dynamic-int8": Recipe(smoothed_dynamic_int8, revision=1),
    "gguf-q8_0": Recipe(gguf_q8_0, revision=1),
}
