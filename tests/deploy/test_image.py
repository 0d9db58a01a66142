"""The Dockerfile every pod runs, read as text (the full tier builds and runs it:
tests/e2e/test_image_stack.py): what it copies exists, the models it bakes in are the
ones the services' defaults name, the base image holds every library the engine links,
and the paths, user and entrypoint it sets are the ones the Helm chart relies on. Plus
the model store's side of a read-only image: verifying prepared models writes nothing it
needs."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from ragline.models import ModelStore
from support import REPO_ROOT, load_tool

pytestmark = pytest.mark.deploy

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
VALUES = yaml.safe_load((REPO_ROOT / "deploy/k8s/helm/ragline/values.yaml").read_text())
SERVICES_TEMPLATE = (REPO_ROOT / "deploy/k8s/helm/ragline/templates/services.yaml").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions(DOCKERFILE)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def final_env() -> dict[str, str]:
    env = {}
    for word, rest in final_stage():
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_every_copied_path_exists_and_local_state_stays_out():
    sources = [
        shlex.split(rest)[:-1]
        for word, rest in instructions(DOCKERFILE)
        if word == "COPY" and "--from" not in rest
    ]
    assert sources
    for paths in sources:
        for path in paths:
            assert (REPO_ROOT / path).exists(), path
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv", ".venv-triton", ".ragline", "libs/ragline/v1/*_pb2*.py"):
        assert path in ignored


def test_the_image_bakes_in_the_models_the_chart_names(monkeypatch):
    from ragline_app.commands.models import default_models

    match = re.search(r'^ARG MODELS="([^"]*)"', DOCKERFILE, re.MULTILINE)
    baked = set(match.group(1).split())
    store = ModelStore()
    for name in baked:
        assert store.spec(name).preparable, f"{name} is not prepared from a package"
    # The services' defaults as the chart's values set them (it serves one generation tier).
    for key, value in VALUES["config"].items():
        if key.endswith("_MODEL"):
            monkeypatch.setenv(key, str(value))
    named = set(default_models())
    assert "qwen2.5-coder-0.5b-q8" in named and named <= baked


def test_the_chart_reads_models_and_engines_where_the_image_puts_them():
    env, config = final_env(), VALUES["config"]
    assert config["RAGLINE_MODEL_DIR"] == env["RAGLINE_MODEL_DIR"]
    assert config["RAGLINE_GENERATION_ENGINES_DIR"] == env["RAGLINE_GENERATION_ENGINES_DIR"]
    assert f"prebuilt.py {env['RAGLINE_GENERATION_ENGINES_DIR']}" in DOCKERFILE
    # No fixed binary: each node runs the fastest engine its CPU has.
    assert config["RAGLINE_GENERATION_LLAMA_SERVER"] == ""
    # The pod's writable volumes are the cache, data and tmp mounts, nothing in the image.
    assert config["RAGLINE_CACHE_DIR"] == "/cache" and config["RAGLINE_DATA_DIR"] == "/data"


def test_user_and_entrypoint_match_the_pods():
    stage = dict(final_stage())
    assert f"runAsUser: {stage['USER']}" in SERVICES_TEMPLATE
    assert stage["ENTRYPOINT"] == '["ragline"]'
    assert 'args: ["serve", "{{ $name }}"]' in SERVICES_TEMPLATE


def test_a_read_only_prepared_store_still_verifies(tmp_path, monkeypatch):
    """Files copied into an image keep their hashes but may get new mtimes, which makes
    the store hash again and try to rewrite its stamp: on a read-only root that write
    fails, and verifying must not."""
    source = ModelStore()
    source.prepare("minilm-ce-l3-int8")
    store = ModelStore(tmp_path / "models")
    shutil.copytree(source.directory("minilm-ce-l3-int8"), store.directory("minilm-ce-l3-int8"))
    for path in store.directory("minilm-ce-l3-int8").iterdir():
        os.utime(path, ns=(1, 1))  # the stamp no longer matches: a re-hash and a rewrite
    written = []

    def read_only(self, *args, **kwargs):
        written.append(self)
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(type(tmp_path), "write_text", read_only)
    store.verify("minilm-ce-l3-int8")
    assert written  # the write was tried and refused


# In every Debian image, a minbase debootstrap included: glibc, and libgcc-s1 (protected).
DEBIAN_BASE = {"libc6", "libgcc-s1"}


def base_image_packages() -> set[str]:
    """The packages tools/make_image.py puts in the base beyond a minimal Debian."""
    return set(load_tool("make_image").BASE_PACKAGES)


def linked_packages(binary) -> dict[str, str]:
    """Debian package of each shared library `binary` loads (ldd, then dpkg -S)."""
    import subprocess

    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
    found = {}
    for line in ldd.stdout.splitlines():
        if "=>" not in line or "not found" in line:
            assert "not found" not in line, f"{binary}: {line.strip()}"
            continue
        library = line.split("=>")[1].split("(")[0].strip()
        if Path(library).parent == Path(binary).parent:
            continue  # shipped beside the binary (the prebuilt's own libraries), not a package
        real = os.path.realpath(library)
        owner = subprocess.run(["dpkg", "-S", real], capture_output=True, text=True)
        if owner.returncode != 0:  # a merged-/usr path dpkg knows by its other name
            owner = subprocess.run(["dpkg", "-S", library], capture_output=True, text=True)
        assert owner.returncode == 0, f"no Debian package owns {library}"
        found[line.split("=>")[0].strip()] = owner.stdout.split(":")[0]
    return found


def test_every_library_the_prebuilt_engines_link_is_in_the_base_image():
    """The image carries the prebuilt engines the tests run here: the libraries they load
    must be in the base, or generation fails to start in every pod."""
    from ragline.config import CommonConfig
    from ragline_services.generation.prebuilt import PREBUILT_ENGINES

    if shutil.which("dpkg") is None:
        pytest.skip("not a Debian machine: the image's packages cannot be named here")
    installed = [
        e.binary(CommonConfig().cache_dir)
        for e in PREBUILT_ENGINES
        if e.binary(CommonConfig().cache_dir).exists()
    ]
    assert installed, "no prebuilt engine: `make test-engines`"
    for binary in installed:
        needed = linked_packages(binary)
        assert {"libgomp.so.1", "libstdc++.so.6"} <= set(needed), needed  # built with them
        missing = set(needed.values()) - base_image_packages() - DEBIAN_BASE
        assert not missing, f"the base image lacks {sorted(missing)} ({needed})"


def test_the_final_stage_runs_the_engine_and_imports_every_service_before_it_is_done():
    runs = [rest for word, rest in final_stage() if word == "RUN"]
    smoke = next((r for r in runs if "engine_version" in r), "")
    assert "ragline --help" in smoke and "service_names()" in smoke, runs
    assert "assert not ran.failure" in smoke, smoke
