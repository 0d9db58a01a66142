"""Slots sized from memory (generation/memory.py), and the GGUF header reader it uses."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ragline_services.generation.memory import (
    COMPUTE_OVERHEAD,
    ModelShape,
    NotEnoughMemory,
    model_shape,
    plan_slots,
)

MIB = 1 << 20
# SmolLM2-135M's shape (read from its GGUF): 30 layers, 3 KV heads of 64.
SMOLLM2 = ModelShape("llama", layers=30, kv_heads=3, key_dim=64, value_dim=64, file_bytes=94 * MIB)


def plan(**kw):
    options = dict(context_per_seq=2048, cache_type_k="f16", cache_type_v="f16", max_num_seqs=8)
    return plan_slots(SMOLLM2, **{**options, **kw})


def test_kv_bytes_per_token_follow_the_cache_types():
    assert SMOLLM2.kv_bytes_per_token("f16", "f16") == 30 * 3 * 64 * 2 * 2  # 23,040
    assert SMOLLM2.kv_bytes_per_token("q8_0", "q8_0") == pytest.approx(30 * 3 * 128 * 34 / 32)
    assert SMOLLM2.kv_bytes_per_token("q4_0", "q4_0") < SMOLLM2.kv_bytes_per_token("q8_0", "q8_0")


def test_slots_are_what_the_budget_holds_capped_by_max_num_seqs():
    kv = 2048 * 23040
    fixed = 94 * MIB + COMPUTE_OVERHEAD
    assert plan(budget=fixed + 2 * kv + kv // 2).slots == 2
    assert plan(budget=fixed + 100 * kv).slots == 8  # the hard cap
    # two tiers share the budget
    assert plan(budget=2 * (fixed + 3 * kv), tiers=2).slots == 3
    # a quantized cache holds more sequences in the same memory
    assert plan(budget=fixed + 3 * kv, cache_type_k="q8_0", cache_type_v="q8_0").slots == 5


def test_less_than_one_slot_refuses_with_what_to_change():
    with pytest.raises(NotEnoughMemory, match="RAGLINE_GENERATION_MEMORY_BUDGET_MB"):
        plan(budget=94 * MIB + COMPUTE_OVERHEAD + 1000)


def gguf(path: Path, pairs: list[tuple[str, int, bytes]]) -> Path:
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    body = b"".join(string(k) + struct.pack("<I", kind) + value for k, kind, value in pairs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs)) + body)
    return path


def test_the_gguf_reader_finds_the_shape_and_skips_arrays(tmp_path):
    vocabulary = struct.pack("<IQ", 8, 2) + b"".join(
        struct.pack("<Q", len(t)) + t for t in (b"hello", b"world")
    )
    path = gguf(
        tmp_path / "m.gguf",
        [
            ("general.architecture", 8, struct.pack("<Q", 5) + b"qwen2"),
            ("tokenizer.ggml.tokens", 9, vocabulary),
            ("qwen2.block_count", 4, struct.pack("<I", 24)),
            ("qwen2.embedding_length", 4, struct.pack("<I", 896)),
            ("qwen2.attention.head_count", 4, struct.pack("<I", 14)),
            ("qwen2.attention.head_count_kv", 4, struct.pack("<I", 2)),
            ("qwen2.scores", 9, struct.pack("<IQ", 6, 3) + b"\0" * 12),
        ],
    )
    shape = model_shape(path)
    assert (shape.layers, shape.kv_heads, shape.key_dim, shape.value_dim) == (24, 2, 64, 64)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(ValueError, match="not a GGUF"):
        model_shape(tmp_path / "x.bin")
