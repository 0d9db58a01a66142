"""Small GGUF files for tests, and ggml's block decoders written out value by value as
`ggml-quants.c` does (scalar loops), to check ragline.models.gguf_q8's vectorised ones."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ragline.models import gguf_q8


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def metadata_entries(file_type: int) -> list[bytes]:
    """A string, an array of strings (a vocabulary), an array of floats, and the file type."""
    return [
        _string("general.architecture") + struct.pack("<I", 8) + _string("llama"),
        _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3)
        + b"".join(_string(t) for t in ("<s>", "héllo", "world")),
        _string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3)
        + struct.pack("<3f", 0.0, -1.5, -2.5),
        _string("general.file_type") + struct.pack("<II", 4, file_type),
    ]  # fmt: skip


def write_gguf(
    path: Path, tensors: list[tuple[str, tuple[int, ...], int, bytes]], alignment: int = 32
) -> None:
    """A GGUF v3 file of `tensors` (name, ggml dims, ggml type, data), with the metadata
    above (and `general.alignment` where it is not the default)."""
    entries = metadata_entries(file_type=15)
    if alignment != 32:
        entries.append(_string("general.alignment") + struct.pack("<II", 4, alignment))
    infos, offset = [], 0
    for name, dims, kind, data in tensors:
        infos.append(
            _string(name) + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
        )  # fmt: skip
        offset += len(data) + (-len(data) % alignment)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(entries))
    head += b"".join(entries) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    body = b"".join(data + b"\0" * (-len(data) % alignment) for _, _, _, data in tensors)
    path.write_bytes(head + body)


def random_blocks(kind: int, count: int, rng: np.random.Generator) -> bytes:
    """`count` blocks of random bits with small finite fp16 scales."""
    block = gguf_q8.BLOCKS[kind]
    raw = rng.integers(0, 256, size=(count, block.bytes), dtype=np.uint8)
    scale_at = {gguf_q8.Q6_K: (208,), gguf_q8.Q4_K: (0, 2), gguf_q8.Q5_K: (0, 2)}.get(
        kind, (0, 2) if kind in (gguf_q8.Q4_1, gguf_q8.Q5_1) else (0,)
    )
    for at in scale_at:
        scales = rng.uniform(-0.05, 0.05, size=count).astype("<f2")
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(count, 2)
    return raw.tobytes()


def _h(raw: bytes, at: int) -> float:
    return float(np.frombuffer(raw[at : at + 2], "<f2")[0])


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def reference_block(kind: int, b: bytes) -> list[float]:  # one case per type
    """One block's values, as ggml's dequantize_row_* computes them."""
    y = [0.0] * gguf_q8.BLOCKS[kind].values
    if kind == gguf_q8.Q8_0:
        return [_h(b, 0) * v for v in np.frombuffer(b[2:34], np.int8)]
    if kind in (gguf_q8.Q4_0, gguf_q8.Q4_1):
        d, m, qs = _h(b, 0), (_h(b, 2) if kind == gguf_q8.Q4_1 else 0.0), b[-16:]
        for j in range(16):
            lo, hi = qs[j] & 0x0F, qs[j] >> 4
            if kind == gguf_q8.Q4_0:
                y[j], y[j + 16] = (lo - 8) * d, (hi - 8) * d
            else:
                y[j], y[j + 16] = lo * d + m, hi * d + m
        return y
    if kind in (gguf_q8.Q5_0, gguf_q8.Q5_1):
        one = kind == gguf_q8.Q5_1
        d, m = _h(b, 0), (_h(b, 2) if one else 0.0)
        qh = struct.unpack("<I", b[4:8] if one else b[2:6])[0]
        qs = b[-16:]
        for j in range(16):
            x0 = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)
            x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)
            if one:
                y[j], y[j + 16] = x0 * d + m, x1 * d + m
            else:
                y[j], y[j + 16] = (x0 - 16) * d, (x1 - 16) * d
        return y
    if kind in (gguf_q8.Q4_K, gguf_q8.Q5_K):
        d, dmin, scales = _h(b, 0), _h(b, 2), b[4:16]
        five = kind == gguf_q8.Q5_K
        qh, ql = (b[16:48], b[48:176]) if five else (b"", b[16:144])
        at, u1, u2 = 0, 1, 2
        for j in range(0, 256, 64):
            sc1, m1 = _scale_min_k4(j // 32, scales)
            sc2, m2 = _scale_min_k4(j // 32 + 1, scales)
            q = ql[j // 2 : j // 2 + 32]
            for n in range(32):
                high1 = 16 if five and qh[n] & u1 else 0
                high2 = 16 if five and qh[n] & u2 else 0
                y[at + n] = d * sc1 * ((q[n] & 0xF) + high1) - dmin * m1
                y[at + 32 + n] = d * sc2 * ((q[n] >> 4) + high2) - dmin * m2
            at, u1, u2 = at + 64, u1 << 2, u2 << 2
        return y
    if kind == gguf_q8.Q6_K:
        ql, qh, d = b[0:128], b[128:192], _h(b, 208)
        sc = np.frombuffer(b[192:208], np.int8)
        for half in range(2):
            lo, hi, s, base = ql[64 * half :], qh[32 * half :], sc[8 * half :], 128 * half
            for n in range(32):
                i = n // 16
                q1 = ((lo[n] & 0xF) | (((hi[n] >> 0) & 3) << 4)) - 32
                q2 = ((lo[n + 32] & 0xF) | (((hi[n] >> 2) & 3) << 4)) - 32
                q3 = ((lo[n] >> 4) | (((hi[n] >> 4) & 3) << 4)) - 32
                q4 = ((lo[n + 32] >> 4) | (((hi[n] >> 6) & 3) << 4)) - 32
                y[base + n] = d * s[i] * q1
                y[base + n + 32] = d * s[i + 2] * q2
                y[base + n + 64] = d * s[i + 4] * q3
                y[base + n + 96] = d * s[i + 6] * q4
        return y
    raise ValueError(kind)
