"""/proc/cpuinfo flag sets of real CPU generations, for the tests of which engine a CPU gets
(the flags Linux prints for each; only the instruction-set ones matter here)."""

from __future__ import annotations

_SSE = {"fpu", "mmx", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "pclmulqdq", "aes"}
# Intel Haswell (2013), the oldest AVX2 CPU: what `qemu-x86_64 -cpu Haswell` emulates.
HASWELL = _SSE | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "rdrand"}
# AMD Zen 4 (2022): AVX-512 with VNNI and BF16, no AMX.
ZEN4 = HASWELL | {
    "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi",
    "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16",
}  # fmt: skip
# AMD Zen 5 (2024): Zen 4's and AVX-VNNI (VEX-encoded vpdpbusd), no AMX.
ZEN5 = ZEN4 | {"avx_vnni", "avx512_vp2intersect", "movdiri", "movdir64b"}
# Intel Sapphire Rapids (2023): Zen 4's, AVX-VNNI and AMX.
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "avx_vnni"}
# An x86-64 from before AVX2 (Sandy Bridge, 2011).
SANDY_BRIDGE = _SSE | {"avx"}
