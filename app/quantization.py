"""Static int8 quantization of an ONNX graph (the export tools' one way to make a fast,
batch-invariant model).

QDQ format, int8 per-channel weights, uint8 activations whose scales are calibrated once
on real inputs and then fixed: unlike dynamic quantization (scales computed per batch at
run time), a text's vector does not depend on what else shares its batch, so batching
across callers and tenants stays safe.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def quantize_static_qdq(
    fp32: Path,
    int8: Path,
    calibration: Iterable[dict[str, np.ndarray]],
    op_types: tuple[str, ...] = ("MatMul", "Gemm", "Gather"),
) -> None:
    """Writes `int8` from `fp32`; `calibration` yields input feeds (name -> array). Gather
    is quantized by default: the word embeddings are most of a BERT's weights."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter(calibration)

        def get_next(self):
            return next(self.feeds, None)

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared),
            str(int8),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            weight_type=QuantType.QInt8,
            activation_type=QuantType.QUInt8,
            op_types_to_quantize=list(op_types),
            extra_options={"ActivationSymmetric": False},
        )
