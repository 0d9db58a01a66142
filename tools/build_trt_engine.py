"""Build a TensorRT engine for the embedding model from its ONNX export (on a GPU node).

    python tools/build_trt_engine.py --onnx ~/.cache/ragline/models/minilm-l6-fp32/model.onnx \
        --out deploy/triton/embedding/gpu/minilm_l6/1/model.plan [--fp32] [--verify]

Uses the TensorRT Python API: the ONNX parser, FP16 unless --fp32, and one optimisation
profile over the dynamic batch and sequence axes of `input_ids` / `attention_mask`
(min 1x1, opt --opt-batch x --opt-tokens, max --max-batch x --max-tokens). The engine is
specific to the GPU and the TensorRT version it was built with: build it where it runs.
--verify runs the engine on real sentences (through torch's CUDA tensors) and compares it
with ONNX Runtime on the same ONNX file (cosine; FP16 should stay above 0.999).

`tensorrt` is not installable on a machine without NVIDIA's libraries (PyPI only has
stubs that fetch from NVIDIA's index); this tool says so instead of failing obscurely.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

INPUTS = ("input_ids", "attention_mask")
OUTPUT = "sentence_embedding"


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as error:
        raise SystemExit(
            "tools/build_trt_engine.py needs TensorRT (`import tensorrt` failed: "
            f"{error}). Run it on a GPU node with TensorRT installed, e.g. inside NVIDIA's "
            "Triton or TensorRT container (pip install tensorrt there), not on a CPU-only "
            "machine."
        ) from error
    return trt


def build(args) -> bytes:
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(args.onnx.read_bytes()):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"TensorRT could not parse {args.onnx}:\n{errors}")
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    if names != set(INPUTS):
        raise SystemExit(f"{args.onnx} has inputs {sorted(names)}, expected {list(INPUTS)}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, args.workspace_mib << 20)
    if not args.fp32:
        if not builder.platform_has_fast_fp16:
            print("warning: this GPU has no fast FP16; building anyway", file=sys.stderr)
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name in INPUTS:
        profile.set_shape(
            name, (1, 1), (args.opt_batch, args.opt_tokens), (args.max_batch, args.max_tokens)
        )
    config.add_optimization_profile(profile)
    started = time.monotonic()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit("TensorRT failed to build the engine (see the log above)")
    print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return bytes(serialized)


def verify(args, engine_bytes: bytes) -> float:
    import numpy as np
    import torch

    from ragline.batching import pad
    from ragline.embedding_backends import OnnxRuntimeBackend
    from ragline.models import ModelStore
    from ragline.pooling import normalise
    from ragline.tokenization import Tokenizer
    from ragline_app.datasets import load_squad

    trt = import_tensorrt()
    store = ModelStore()
    tokenizer = Tokenizer(store.file("all-minilm-l6-v2", "tokenizer.json"), args.max_tokens)
    passages, questions = load_squad(args.texts)
    texts = [q.text for q in questions[:32]] + [p.text for p in passages[:32]]
    ids, mask = pad(tokenizer.encode(texts, refuse_over_limit=False))
    expected = OnnxRuntimeBackend(args.onnx).run(ids, mask)

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    context = engine.create_execution_context()
    device_inputs = {
        name: torch.from_numpy(array).cuda()
        for name, array in (("input_ids", ids), ("attention_mask", mask))
    }
    for name, tensor in device_inputs.items():
        context.set_input_shape(name, tuple(tensor.shape))
        context.set_tensor_address(name, tensor.data_ptr())
    output = torch.empty((ids.shape[0], expected.shape[1]), dtype=torch.float32, device="cuda")
    context.set_tensor_address(OUTPUT, output.data_ptr())
    stream = torch.cuda.Stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise SystemExit("TensorRT execution failed")
    stream.synchronize()
    got = normalise(output.cpu().numpy())
    cosine = float(np.min(np.sum(got * expected, axis=1)))
    print(f"verify: {len(texts)} texts, min cosine TensorRT vs ONNX Runtime = {cosine:.6f}")
    return cosine


DECLARED = ("ragline_model_version", "ragline_batch_invariant")


def declare(config_text: str, version: str, batch_invariant: bool) -> str:
    """The repository's config.pbtxt with the parameters by which the embedding service
    labels this engine's vectors (its own version, not the ONNX file's it was built from)
    and decides whether to batch; earlier declarations replaced."""
    kept = [
        line
        for line in config_text.splitlines()
        if not any(f'key: "{name}"' in line for name in DECLARED)
    ]
    values = {DECLARED[0]: version, DECLARED[1]: "true" if batch_invariant else "false"}
    kept += [
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in values.items()
    ]
    return "\n".join(kept) + "\n"


def engine_version(source_model: str, engine: bytes, fp32: bool) -> str:
    """`<source>-trt-<precision>@<sha256 of the plan, 16 hex>`: one engine, one version."""
    precision = "fp32" if fp32 else "fp16"
    return f"{source_model}-trt-{precision}@{hashlib.sha256(engine).hexdigest()[:16]}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--onnx", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fp32", action="store_true", help="no FP16 kernels")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--opt-batch", type=int, default=16)
    parser.add_argument("--opt-tokens", type=int, default=64)
    parser.add_argument("--workspace-mib", type=int, default=2048)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument(
        "--texts",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "app/ragline_app/data/squad_dev_sample.json",
    )
    parser.add_argument(
        "--source-model",
        default="minilm-l6-fp32",
        help="the manifest model the ONNX file is (the version's prefix)",
    )
    args = parser.parse_args()
    engine = build(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(engine)
    print(f"wrote {args.out} ({len(engine) / 1e6:.1f} MB)")
    if args.verify and verify(args, engine) < 0.999:
        print("verify failed: cosine below 0.999", file=sys.stderr)
        return 1
    # <model>/<version>/model.plan: the model's config.pbtxt is two folders up.
    config = args.out.parent.parent / "config.pbtxt"
    if config.exists():
        version = engine_version(args.source_model, engine, args.fp32)
        # No activation is quantized from its batch: a text's vector does not depend on
        # what shares its run, so the service may batch.
        config.write_text(declare(config.read_text(), version, batch_invariant=True))
        print(f"declared {version} in {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
