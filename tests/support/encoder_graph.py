"""A small real ONNX encoder for the model-derivation tests: the shape of the shipped
MiniLM graph (weights-only int8 MatMul, erf GELU, masked token outputs) at toy size."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH, VOCAB = 32, 512


def encoder_graph(
    path: Path, *, outlier_channels: tuple[int, ...] = (), outlier_gain: float = 1.0
) -> None:
    """input_ids -> embedding -> int8-weight MatMul (Cast * scale, as the shipped graph
    stores it) -> erf GELU -> MatMul -> masked last_hidden_state [batch, seq, WIDTH].
    `outlier_channels` of the embedding table are scaled by `outlier_gain`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    table = rng.normal(size=(VOCAB, WIDTH)).astype(np.float32)
    # A real transformer's activations have a few channels far larger than the rest.
    table[:, list(outlier_channels)] *= outlier_gain
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
