"""Large request buffers go back to the OS when freed.

glibc's malloc serves blocks above its mmap threshold (128 KiB) with mmap and unmaps them
on free, but raises the threshold to the largest block freed (up to 32 MiB): after a few
MiB-sized requests, later ones come from the heap, which keeps them. A service that
received a flood of large requests then holds their memory long after refusing them
(tools/bench_generation_memory.py measures it). Fixing the threshold keeps every large
block mapped only while it lives.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def fix_mmap_threshold(threshold_bytes: int = 128 * 1024) -> bool:
    """True when glibc took the setting (False elsewhere: musl, macOS)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False
