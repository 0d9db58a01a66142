"""Int8 quantization of an ONNX graph: static (the fast, batch-invariant way) and dynamic
(faster per text, run one text at a time).

Static: QDQ format, int8 per-channel weights, uint8 activations whose scales are calibrated
once on real inputs and then fixed: a text's vector does not depend on what else shares its
batch, so batching across callers and tenants stays safe. Dynamic: scales computed per run
at run time, so a text's vector depends on its run's other texts; whoever runs such a graph
runs it one text at a time.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


@contextmanager
def _preprocessed(fp32: Path) -> Iterator[Path]:
    """`fp32` after ONNX Runtime's pre-quantization pass (shape inference, fusions the
    quantizer expects), in a temporary file for the life of the block."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        yield prepared


def matmuls_after_gelu(model_path: Path) -> list[str]:
    """Names of the MatMul nodes whose first input is a GELU's output: the feed-forward
    output projections, whose inputs have the outlier activations that one int8 scale per
    tensor cannot hold. GELU is a `Gelu` node (torch's exporter) or its erf form
    `x * 0.5 * (1 + erf(x / sqrt 2))` ending in a Mul (other exporters, folded graphs)."""
    import onnx

    graph = onnx.load(str(model_path)).graph
    producers = {output: node for node in graph.node for output in node.output}

    def is_gelu(node: onnx.NodeProto | None, depth: int = 0) -> bool:
        if node is None or depth > 3:
            return False
        if node.op_type in ("Gelu", "Erf"):
            return True
        if node.op_type not in ("Mul", "Add"):
            return False
        return any(is_gelu(producers.get(name), depth + 1) for name in node.input)

    found = [
        node
        for node in graph.node
        if node.op_type == "MatMul" and is_gelu(producers.get(node.input[0]))
    ]
    if any(not node.name for node in found):
        # The quantizer excludes nodes by name: an empty one would exclude every unnamed node.
        raise ValueError(f"{model_path}: MatMul nodes after GELU have no names to exclude")
    return [node.name for node in found]


def quantize_static_qdq(
    fp32: Path,
    int8: Path,
    calibration: Iterable[dict[str, np.ndarray]],
    op_types: tuple[str, ...] = ("MatMul", "Gemm", "Gather"),
    *,
    weights_only_matmuls: bool = False,
    keep_fp32_after_gelu: bool = False,
) -> None:
    """Writes `int8` from `fp32`; `calibration` yields input feeds (name -> array). Gather
    is quantized by default: the word embeddings are most of a BERT's weights.
    `weights_only_matmuls` leaves activation x activation products (attention) in fp32;
    `keep_fp32_after_gelu` leaves the MatMuls fed by a GELU in fp32."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    # onnxruntime ships no type information: its base class is Any to the checker.
    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.feeds = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    with _preprocessed(fp32) as prepared:
        excluded = matmuls_after_gelu(prepared) if keep_fp32_after_gelu else []
        quantize_static(
            str(prepared),
            str(int8),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            weight_type=QuantType.QInt8,
            activation_type=QuantType.QUInt8,
            op_types_to_quantize=list(op_types),
            nodes_to_exclude=excluded,
            extra_options={
                "ActivationSymmetric": False,
                "MatMulConstBOnly": weights_only_matmuls,
            },
        )


def quantize_dynamic_int8(fp32: Path, int8: Path, op_types: tuple[str, ...] = ("MatMul",)) -> None:
    """Writes `int8` from `fp32`: per-channel int8 weights of the MatMuls with a constant
    weight (ONNX Runtime's dynamic mode leaves activation x activation products in fp32);
    activation scales are computed at run time from each run's input."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _preprocessed(fp32) as prepared:
        quantize_dynamic(
            str(prepared),
            str(int8),
            per_channel=True,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=list(op_types),
            extra_options={"MatMulConstBOnly": True},
        )
