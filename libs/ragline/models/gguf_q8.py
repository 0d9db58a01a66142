"""A GGUF model with its quantized weights rewritten as Q8_0, with numpy alone.

Why: llama.cpp runs a weight type fast only where the CPU backend has a kernel built for
it. Qwen2.5-Coder-0.5B's Q4_K_M file is mostly Q5_0 (its 896-wide rows do not fit the
256-value K-quant blocks), which neither the AMX tiles nor the repacked AVX2 kernels read:
on a Xeon with AMX its prompt is read at ~200 tokens/s, the same weights in Q8_0 at ~800
(docs/models.md, "The small model in Q8_0"). Q8_0 holds a Q5_0 or Q4_K weight to within
about a sixteenth of its own step (a Q6_K one an eighth), so the model answers as before.

Everything but the tensor data is copied: the metadata (tokenizer, chat template, ...)
byte for byte, except `general.file_type`, which says Q8_0. F32, F16 and BF16 tensors
(norms, biases) and Q8_0 tensors are kept as they are. Format: ggml's `gguf.md` (version 2
and 3 files) and the block layouts of `ggml-common.h`.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# ggml_type numbers.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
KEPT = frozenset({F32, F16, BF16, Q8_0})
# llama_ftype of a file whose weights are Q8_0.
FILE_TYPE_Q8_0 = 7
# A requantized tensor is refused above this RMS error relative to its weights' RMS, or where
# it is not finite (a scale of inf or NaN): Q8_0 of a 4-6 bit weight measures 0.2-0.6%.
MAX_RELATIVE_RMS_ERROR = 0.02

# GGUF metadata value types: struct format of the fixed-size ones.
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip


class GgufError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    type: int
    offset: int  # from the start of the data section

    @property
    def count(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64))


@dataclass(frozen=True)
class Layout:
    version: int
    metadata: bytes  # the key-value section, as read
    metadata_count: int
    file_type_at: int | None  # where general.file_type's uint32 value sits in `metadata`
    alignment: int
    tensors: tuple[TensorInfo, ...]
    data_start: int


class _Reader:
    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        raw = self.stream.read(size)
        if len(raw) != size:
            raise GgufError("the file ends inside its header")
        value: int | float | bool = struct.unpack(fmt, raw)[0]
        return value

    def string(self) -> str:
        length = int(self.take("<Q"))
        return self.stream.read(length).decode("utf-8")

    def value(self, kind: int) -> object:
        if kind in _SCALAR:
            return self.take(_SCALAR[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = int(self.take("<I")), int(self.take("<Q"))
            if item in _SCALAR:  # skipped whole: a vocabulary's scores hold 150k of them
                self.stream.seek(struct.calcsize(_SCALAR[item]) * count, 1)
                return None
            return [self.value(item) for _ in range(count)]
        raise GgufError(f"unknown metadata value type {kind}")


def read_layout(path: Path) -> Layout:
    with path.open("rb") as stream:
        reader = _Reader(stream)
        if stream.read(4) != MAGIC:
            raise GgufError(f"{path} is not a GGUF file")
        version = int(reader.take("<I"))
        if version not in (2, 3):
            raise GgufError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
        tensor_count, metadata_count = int(reader.take("<Q")), int(reader.take("<Q"))
        metadata_start = stream.tell()
        alignment, file_type_at = DEFAULT_ALIGNMENT, None
        for _ in range(metadata_count):
            key = reader.string()
            kind = int(reader.take("<I"))
            if key == "general.file_type" and kind == 4:
                file_type_at = stream.tell() - metadata_start
            value = reader.value(kind)
            if key == "general.alignment" and isinstance(value, int):
                alignment = value
        metadata_end = stream.tell()
        tensors = []
        for _ in range(tensor_count):
            name = reader.string()
            dims = tuple(int(reader.take("<Q")) for _ in range(int(reader.take("<I"))))
            tensors.append(TensorInfo(name, dims, int(reader.take("<I")), int(reader.take("<Q"))))
        data_start = _aligned(stream.tell(), alignment)
        stream.seek(metadata_start)
        metadata = stream.read(metadata_end - metadata_start)
    return Layout(
        version, metadata, metadata_count, file_type_at, alignment, tuple(tensors), data_start
    )


def _aligned(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


# -- the block layouts (ggml-common.h) ----------------------------------------------------------


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as a float32 column."""
    return blocks[:, start : start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles first, then high ones: the order of a 32-value block's 16 bytes."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    out: np.ndarray = _f16(b, 0) * (_nibbles(b[:, 2:18]) - 8)
    return out


def _q4_1(b: np.ndarray) -> np.ndarray:
    out: np.ndarray = _f16(b, 0) * _nibbles(b[:, 4:20]) + _f16(b, 2)
    return out


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of the block's little-endian uint32 `qh` is value j's fifth bit (16 or 0)."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")
    return bits.astype(np.int32) << 4


def _q5_0(b: np.ndarray) -> np.ndarray:
    out: np.ndarray = _f16(b, 0) * ((_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])) - 16)
    return out


def _q5_1(b: np.ndarray) -> np.ndarray:
    out: np.ndarray = _f16(b, 0) * (_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])) + _f16(b, 2)
    return out


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs packed in a K-quant block's 12 bytes."""
    s = scales.astype(np.int32)
    scale = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    minimum = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return scale.astype(np.float32), minimum.astype(np.float32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 0), _f16(b, 2)
    scale, minimum = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 32).astype(np.int32)  # four 64-value groups
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # eight 32-value sub-blocks
    values = (d * scale)[:, :, None] * q - (dmin * minimum)[:, :, None]
    out: np.ndarray = values.reshape(-1, 256)
    return out


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 0), _f16(b, 2)
    scale, minimum = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].astype(np.int32)  # bit 2g / 2g+1 of byte l: sub-block 2g / 2g+1's value l
    qs = b[:, 48:176].reshape(-1, 4, 32).astype(np.int32)
    high = np.stack([(qh >> bit) & 1 for bit in range(8)], axis=1) << 4  # [n, 8, 32]
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32) + high
    values = (d * scale)[:, :, None] * q - (dmin * minimum)[:, :, None]
    out: np.ndarray = values.reshape(-1, 256)
    return out


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 64).astype(np.int32)  # two 128-value halves
    qh = b[:, 128:192].reshape(-1, 2, 32).astype(np.int32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(b, 208)
    low = np.stack(
        [ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4],
        axis=2,
    )  # [n, half, quarter, 32]
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2) << 4
    q = (low | high) - 32
    # Sixteen values per scale: quarter k of a half takes scales 2k and 2k+1.
    per_value = np.repeat(scales.reshape(-1, 2, 4, 2), 16, axis=3)
    out: np.ndarray = (d[:, :, None, None] * per_value * q).reshape(-1, 256)
    return out


@dataclass(frozen=True)
class BlockType:
    values: int
    bytes: int
    dequantize: Callable[[np.ndarray], np.ndarray]


BLOCKS = {
    Q4_0: BlockType(32, 18, _q4_0),
    Q4_1: BlockType(32, 20, _q4_1),
    Q5_0: BlockType(32, 22, _q5_0),
    Q5_1: BlockType(32, 24, _q5_1),
    Q8_0: BlockType(32, 34, _q8_0),
    Q4_K: BlockType(256, 144, _q4_k),
    Q5_K: BlockType(256, 176, _q5_k),
    Q6_K: BlockType(256, 210, _q6_k),
}
_PLAIN = {F32: 4, F16: 2, BF16: 2}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
               Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}  # fmt: skip


def data_bytes(tensor: TensorInfo) -> int:
    if tensor.type in _PLAIN:
        return tensor.count * _PLAIN[tensor.type]
    block = BLOCKS.get(tensor.type)
    if block is None:
        raise GgufError(f"tensor {tensor.name}: ggml type {tensor.type} is not read here")
    return tensor.count // block.values * block.bytes


def dequantize(kind: int, raw: np.ndarray) -> np.ndarray:
    """The float32 values of `raw` (uint8 bytes of whole blocks of ggml type `kind`)."""
    block = BLOCKS[kind]
    return block.dequantize(raw.reshape(-1, block.bytes)).reshape(-1)


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """ggml's reference Q8_0: per 32 values an fp16 scale max|x|/127 and int8 values
    rounded half away from zero; returns the blocks' bytes."""
    x = values.astype(np.float32).reshape(-1, 32)
    d = np.abs(x).max(axis=1, keepdims=True) / 127.0
    inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    scaled = x * inverse
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    blocks = np.empty((x.shape[0], 34), dtype=np.uint8)
    blocks[:, 0:2] = d.astype("<f2").view(np.uint8)
    blocks[:, 2:] = q.view(np.uint8)
    return blocks.reshape(-1)


# -- the rewrite --------------------------------------------------------------------------------

# Blocks dequantized at a time (a 150k-token embedding table is 4M blocks).
_CHUNK_BLOCKS = 1 << 16


def _requantized(kind: int, raw: np.ndarray, name: str) -> tuple[np.ndarray, float]:
    """The Q8_0 bytes of `raw` and their RMS error relative to the weights' RMS."""
    block = BLOCKS[kind]
    blocks = raw.reshape(-1, block.bytes)
    out, error, power = [], 0.0, 0.0
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        with np.errstate(invalid="ignore", over="ignore"):  # such weights are refused next
            values = block.dequantize(blocks[start : start + _CHUNK_BLOCKS]).reshape(-1)
        if not np.all(np.isfinite(values)):
            raise GgufError(f"tensor {name}: weights that are not finite (a scale of inf or NaN)")
        q8 = quantize_q8_0(values)
        back = _q8_0(q8.reshape(-1, 34)).reshape(-1)
        error += float(np.sum((back - values) ** 2, dtype=np.float64))
        power += float(np.sum(values.astype(np.float64) ** 2))
        out.append(q8)
    relative = (error / power) ** 0.5 if power > 0 else 0.0
    if relative > MAX_RELATIVE_RMS_ERROR:
        raise GgufError(
            f"tensor {name}: Q8_0 is {relative:.1%} away from its weights (at most "
            f"{MAX_RELATIVE_RMS_ERROR:.0%}); not written"
        )
    return np.concatenate(out), relative


def _info_bytes(tensor: TensorInfo) -> bytes:
    name = tensor.name.encode("utf-8")
    return b"".join([
        struct.pack("<Q", len(name)), name, struct.pack("<I", len(tensor.dims)),
        *(struct.pack("<Q", d) for d in tensor.dims),
        struct.pack("<IQ", tensor.type, tensor.offset),
    ])  # fmt: skip


def to_q8_0(source: Path, target: Path) -> dict[str, object]:
    """Writes `target`, `source` with every quantized weight in Q8_0; returns what was done
    (tensors rewritten per source type, the worst relative error, seconds). One tensor is in
    memory at a time."""
    started = time.monotonic()
    layout = read_layout(source)
    data = np.memmap(source, dtype=np.uint8, mode="r", offset=layout.data_start)
    infos, offset = [], 0
    for tensor in layout.tensors:
        kind = tensor.type if tensor.type in KEPT else Q8_0
        info = TensorInfo(tensor.name, tensor.dims, kind, offset)
        infos.append(info)
        offset = _aligned(offset + data_bytes(info), layout.alignment)
    metadata = bytearray(layout.metadata)
    if layout.file_type_at is not None:
        metadata[layout.file_type_at : layout.file_type_at + 4] = struct.pack("<I", FILE_TYPE_Q8_0)
    rewritten: Counter[str] = Counter()
    worst = 0.0
    with target.open("wb") as out:
        out.write(MAGIC + struct.pack("<IQQ", layout.version, len(infos), layout.metadata_count))
        out.write(metadata)
        out.write(b"".join(_info_bytes(info) for info in infos))
        out.write(b"\0" * (_aligned(out.tell(), layout.alignment) - out.tell()))
        for tensor, info in zip(layout.tensors, infos, strict=True):
            payload = np.asarray(data[tensor.offset : tensor.offset + data_bytes(tensor)])
            if info.type != tensor.type:
                payload, relative = _requantized(tensor.type, payload, tensor.name)
                worst = max(worst, relative)
                rewritten[TYPE_NAMES[tensor.type]] += 1
            out.write(payload.tobytes())
            end = info.offset + payload.size
            out.write(b"\0" * (_aligned(end, layout.alignment) - end))
    return {
        "requantized": dict(sorted(rewritten.items())),
        "kept": len(infos) - sum(rewritten.values()),
        "relative_rms_error_max": round(worst, 5),
        "seconds": round(time.monotonic() - started, 1),
        "bytes": target.stat().st_size,
    }
