"""How many sequences a tier may decode at once, from memory rather than hope.

llama.cpp allocates every slot's KV cache when the engine starts (slots x context x bytes
per token), so the slot count fixes the engine's memory for good: admitting one more
sequence than there are slots only queues it (or refuses it, RESOURCE_EXHAUSTED), it never
allocates. The rule, per tier:

    kv_per_slot = context_per_seq x layers x kv_heads x (key_dim x bytes(K type)
                                                          + value_dim x bytes(V type))
    fixed       = the model file (mapped weights) + COMPUTE_OVERHEAD
    slots       = min(max_num_seqs, floor((budget / tiers - fixed) / kv_per_slot))

with `budget` = RAGLINE_GENERATION_MEMORY_BUDGET_MB, or else MEMORY_FRACTION of the memory
available when the service starts (the cgroup's limit when there is one). Fewer than one
slot refuses to start, with what would fit.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# Bytes per element of llama.cpp's KV cache types (quantized: a block's bytes / its 32 values).
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# llama.cpp's compute buffers and the server's own state, measured here as 40-150 MiB for
# the packaged models; rounded up.
COMPUTE_OVERHEAD = 256 << 20
MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    file_bytes: int

    def kv_bytes_per_token(self, cache_type_k: str, cache_type_v: str) -> float:
        per_layer = self.kv_heads * (
            self.key_dim * KV_TYPE_BYTES[cache_type_k]
            + self.value_dim * KV_TYPE_BYTES[cache_type_v]
        )
        return self.layers * per_layer


@dataclass(frozen=True)
class SlotPlan:
    slots: int
    kv_per_slot: int
    fixed: int
    budget: int  # this tier's share

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"{self.slots} slot(s) of {self.kv_per_slot / mib:.0f} MiB KV each, "
            f"{self.fixed / mib:.0f} MiB weights and buffers, "
            f"in a {self.budget / mib:.0f} MiB share"
        )


class NotEnoughMemory(Exception):
    pass


def plan_slots(
    shape: ModelShape,
    *,
    context_per_seq: int,
    cache_type_k: str,
    cache_type_v: str,
    max_num_seqs: int,
    budget: int,
    tiers: int = 1,
) -> SlotPlan:
    share = budget // max(tiers, 1)
    kv_per_slot = int(context_per_seq * shape.kv_bytes_per_token(cache_type_k, cache_type_v))
    fixed = shape.file_bytes + COMPUTE_OVERHEAD
    fits = (share - fixed) // kv_per_slot if share > fixed else 0
    if fits < 1:
        mib = 1 << 20
        raise NotEnoughMemory(
            f"one sequence of {context_per_seq} tokens needs {(fixed + kv_per_slot) / mib:.0f} "
            f"MiB ({fixed / mib:.0f} weights and buffers + {kv_per_slot / mib:.0f} KV with "
            f"{cache_type_k}/{cache_type_v}), but this tier's memory share is {share / mib:.0f} "
            "MiB: lower RAGLINE_GENERATION_CONTEXT_PER_SEQ, quantize the KV cache "
            "(RAGLINE_GENERATION_CACHE_TYPE_K/V) or raise RAGLINE_GENERATION_MEMORY_BUDGET_MB"
        )
    return SlotPlan(min(max_num_seqs, int(fits)), kv_per_slot, fixed, share)


def available_memory() -> int:
    """Bytes this process may still use: the cgroup's limit minus its use when one is
    set, else the machine's MemAvailable."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            return max(int(limit) - used, 0)
    except (OSError, ValueError):
        pass
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# -- GGUF metadata: only the few keys above, read from the file's header ------------------------

_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> bytes:
    return f.read(_read(f, "<Q"))


def _value(f: BinaryIO, kind: int):
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f).decode(errors="replace")
    if kind == _ARRAY:  # skipped (tokenizer vocabularies): only lengths are read
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item == _STRING:
            for _ in range(count):
                f.seek(_read(f, "<Q"), os.SEEK_CUR)
        elif item in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item]) * count, os.SEEK_CUR)
        else:
            raise ValueError(f"GGUF array of unsupported type {item}")
        return None
    raise ValueError(f"GGUF value of unknown type {kind}")


def model_shape(path: Path) -> ModelShape:
    """Reads layers, KV heads and head sizes from a GGUF file's metadata (blocking I/O)."""
    meta: dict[str, object] = {}
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _read(f, "<Q")  # tensors
        for _ in range(_read(f, "<Q")):
            key = _string(f).decode(errors="replace")
            meta[key] = _value(f, _read(f, "<I"))
    arch = str(meta["general.architecture"])

    def number(name: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{name}", default)
        if not isinstance(value, int | float | str):
            raise ValueError(f"{path}: no {arch}.{name} in the GGUF metadata")
        return int(value)

    heads = number("attention.head_count")
    head_dim = number("embedding_length") // heads
    return ModelShape(
        architecture=arch,
        layers=number("block_count"),
        kv_heads=number("attention.head_count_kv", heads),
        key_dim=number("attention.key_length", head_dim),
        value_dim=number("attention.value_length", head_dim),
        file_bytes=path.stat().st_size,
    )
