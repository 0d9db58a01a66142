"""`ragline up`: every service as its own process on loopback, started and stopped in order."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragline.clients import open_channel, open_sync_channel
from ragline.processes import dying_with_this_process, free_ports
from ragline.tls import TlsConfig
from ragline_app.etcd_server import EtcdServer
from ragline_services.registry import (
    default_address,
    default_port,
    http_service_names,
    service_names,
)

# Client / peer ports of the local etcd that `ragline up` starts for the budget service.
ETCD_PORT_OFFSETS = (10, 11)
# A service's Prometheus /metrics port in the laptop layout: its gRPC port plus this.
METRICS_PORT_OFFSET = 100


def metrics_key(name: str) -> str:
    """The key of a service's metrics port in a port plan."""
    return f"{name}-metrics"


class StackError(RuntimeError):
    """A service failed to start or died; the message carries the end of its log."""


@dataclass
class ServiceProcess:
    name: str
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen | None = None
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def exit_code(self) -> int | None:
        """The process's exit status (None: not started, or still running)."""
        return self.process.poll() if self.process is not None else None

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def plan_ports(names: list[str], base_port: int | None, host: str) -> dict[str, int]:
    """Default ports, `base_port + offset` in the default layout, or free ports (base 0).

    Besides the services, the plan holds each service's metrics port (`metrics_key`) and
    `etcd` and `etcd-peer` for the local etcd.
    """
    names = [*names, *(metrics_key(name) for name in names), "etcd", "etcd-peer"]
    if base_port == 0:
        return dict(zip(names, free_ports(len(names), host), strict=True))
    base = default_port("orchestrator")
    every = [*service_names(), *http_service_names()]
    offsets = {
        **{name: default_port(name) - base for name in every},
        **{metrics_key(name): default_port(name) - base + METRICS_PORT_OFFSET for name in every},
        "etcd": ETCD_PORT_OFFSETS[0],
        "etcd-peer": ETCD_PORT_OFFSETS[1],
    }
    start = base if base_port is None else base_port
    return {name: start + offsets[name] for name in names}


def health_status_sync(address: str, timeout_s: float = 0.5, tls: TlsConfig | None = None) -> str:
    """The same check without an event loop (tests and tools that start services); `tls`:
    how to reach it (default: this process's RAGLINE_TLS_*)."""
    with open_sync_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def source_pythonpath(checkout: Path) -> str:
    """A PYTHONPATH folder whose ragline packages are `checkout`'s (another clone or
    worktree; its generated stubs copied from this tree where it has none), so a benchmark
    can start the services of that code beside this tree's in one run."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ragline-source-"))
    checkout = checkout.resolve()
    packages = {
        "ragline": checkout / "libs" / "ragline",
        "ragline_services": checkout / "services" / "ragline_services",
        "ragline_app": checkout / "app" / "ragline_app",
    }
    if not packages["ragline_services"].is_dir():
        # A commit from before each folder was named as its package (a baseline to compare).
        packages |= {"ragline_services": checkout / "services", "ragline_app": checkout / "app"}
    for package, source in packages.items():
        (folder / package).symlink_to(source)
    stubs = Path(__file__).resolve().parents[2] / "libs" / "ragline" / "v1"
    for stub in stubs.glob("*_pb2*.py"):
        target = checkout / "libs" / "ragline" / "v1" / stub.name
        if not target.exists():
            shutil.copy(stub, target)
    return str(folder)


def spawn_service(
    name: str, env_extra: dict[str, str], log_path: Path, *, wait_s: float = 600.0
) -> tuple[subprocess.Popen, str]:
    """`ragline serve NAME` on a free loopback port, waited until SERVING (for tools)."""
    port = free_ports(1)[0]
    env = {**os.environ, f"RAGLINE_{name.upper()}_ACCESS_LOG": "false", **env_extra}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ragline_app.cli", "serve", name, "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while health_status_sync(address) != "SERVING":
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{name} service did not start; see {log_path}")
        time.sleep(0.2)
    return process, address


async def health_status(
    address: str, timeout_s: float = 1.0, service: str = "", *, tls=None, credentials=None
) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE for the server at `address` (overall, or the
    health service name `service`: "liveness" is what a liveness probe asks). `tls` and
    `credentials`: made once by a caller that asks again and again (default: from the
    environment, each time)."""
    async with open_channel(address, tls, credentials=credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = await stub.Check(request, timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def http_ready(address: str, timeout_s: float = 1.0, tls: TlsConfig | None = None) -> str:
    """An HTTP service's readiness (GET /readyz) as the gRPC health words: SERVING,
    NOT_SERVING or UNREACHABLE."""
    import httpx

    tls = tls if tls is not None else TlsConfig()
    scheme = "https" if tls.on else "http"
    verify = tls.ssl_client_context() if tls.on else True
    try:
        async with httpx.AsyncClient(verify=verify, timeout=timeout_s) as http:
            reply = await http.get(f"{scheme}://{address}/readyz")
    except httpx.HTTPError:
        return "UNREACHABLE"
    return "SERVING" if reply.status_code == 200 else "NOT_SERVING"


async def service_status(
    name: str,
    address: str,
    timeout_s: float = 1.0,
    *,
    tls: TlsConfig | None = None,
    credentials=None,
) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE of the service registered as `name`: its gRPC
    health, or an HTTP service's /readyz (`credentials`: gRPC channel credentials made
    once from `tls`)."""
    if name in http_service_names():
        return await http_ready(address, timeout_s, tls)
    return await health_status(address, timeout_s, tls=tls, credentials=credentials)


class Stack:
    def __init__(
        self,
        names: list[str],
        ports: dict[str, int],
        log_dir: Path,
        host: str = "127.0.0.1",
        etcd: EtcdServer | None = None,
        metrics: bool = True,
        tls: dict[str, str] | None = None,
    ) -> None:
        """`metrics`: each service serves /metrics on its planned port (False: none, unless
        the environment sets RAGLINE_<NAME>_METRICS_PORT). `tls`: the RAGLINE_TLS_* of the
        services, and `client_tls` what a command calling them uses (`write_state`)."""
        self.host = host
        self.tls = tls or {}
        self.client_tls: dict[str, str] = {}
        # Run once etcd listens, before any service starts (users and roles).
        self.etcd_setup: Callable[[], None] | None = None
        self.log_dir = log_dir
        self.etcd = etcd
        self.services = [
            ServiceProcess(
                name,
                host,
                ports[name],
                log_dir / f"{name}.log",
                metrics_port=ports.get(metrics_key(name)) if metrics else None,
            )
            for name in names
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for svc in self.services:
            upper = svc.name.upper()
            env[f"RAGLINE_{upper}_PORT"] = str(svc.port)
            env[f"RAGLINE_{upper}_HOST"] = svc.host
            env[f"RAGLINE_{upper}_ADDR"] = svc.address
            # Metrics are on in `ragline up` (for `ragline top`), on a port the environment
            # may choose instead.
            configured = env.get(f"RAGLINE_{upper}_METRICS_PORT", "").strip()
            if configured.isdigit() and int(configured):
                svc.metrics_port = int(configured)
            if svc.metrics_port is not None:
                env[f"RAGLINE_{upper}_METRICS_PORT"] = str(svc.metrics_port)
        if self.etcd is not None:
            env["RAGLINE_BUDGET_ETCD_ENDPOINTS"] = self.etcd.endpoint
        env.update(self.tls)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.etcd is not None:
            self.etcd.start(start_new_session=True, die_with_parent=True)
            if self.etcd_setup is not None:
                self.etcd_setup()
        env = self.environment()
        for svc in self.services:
            log_file = svc.log_path.open("ab")
            # A session of its own: Ctrl-C reaches only `ragline up`, which stops the
            # services in order instead of all of them at once.
            svc.process = subprocess.Popen(
                # SIGTERM when `ragline up` dies (even by -9).
                dying_with_this_process(
                    [sys.executable, "-m", "ragline_app.cli", "serve", svc.name]
                ),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            log_file.close()

    def dead(self) -> list[ServiceProcess]:
        return [s for s in self.services if s.process is not None and s.process.poll() is not None]

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.services)
        # Read once, not at every poll (under TLS: the files, and the key checked against
        # its certificate); a fresh channel each poll still sees a server the moment it
        # listens.
        tls = TlsConfig()
        credentials = tls.channel_credentials() if tls.on else None
        while pending:
            for svc in self.dead():
                raise StackError(
                    f"{svc.name} exited with code {svc.exit_code} during start; "
                    f"end of {svc.log_path}:\n{svc.log_tail()}"
                )
            statuses = await asyncio.gather(
                *(
                    service_status(s.name, s.address, tls=tls, credentials=credentials)
                    for s in pending
                )
            )
            pending = [
                s for s, status in zip(pending, statuses, strict=True) if status != "SERVING"
            ]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise StackError(
                    f"not serving after {timeout_s:.0f} s: {names} (see {self.log_dir})"
                )
            await asyncio.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order, then SIGKILL whatever outlives the grace period."""
        running = [
            s.process
            for s in reversed(self.services)
            if s.process is not None and s.process.poll() is None
        ]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in running:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        codes = {s.name: s.exit_code for s in self.services}
        if self.etcd is not None:
            codes["etcd"] = self.etcd.stop(timeout_s=grace_s)
        return codes

    def write_state(self, path: Path) -> None:
        state = {
            "etcd": self.etcd.endpoint if self.etcd is not None else None,
            "tls": self.client_tls,
            "services": {
                s.name: {
                    "address": s.address,
                    "metrics": s.metrics_url,
                    "pid": s.process.pid if s.process else None,
                    "log": str(s.log_path),
                }
                for s in self.services
            },
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state, indent=2))


def read_state_metrics(path: Path) -> dict[str, str]:
    """Service -> its /metrics URL, as a running `ragline up` recorded them."""
    try:
        services = json.loads(path.read_text())["services"]
    except (OSError, KeyError, ValueError):
        return {}
    return {name: entry["metrics"] for name, entry in services.items() if entry.get("metrics")}


def use_stack_tls(data_dir: Path) -> None:
    """A command's RAGLINE_TLS_* from the running `ragline up --tls`, where the environment
    sets none: `ragline ask` then speaks TLS (and presents the stack's client certificate
    under mTLS) with nothing to pass."""
    if os.environ.get("RAGLINE_TLS_MODE", "").strip():
        return
    try:
        recorded = json.loads((data_dir / "up.json").read_text()).get("tls") or {}
    except (OSError, ValueError, AttributeError):
        return
    os.environ.update({k: str(v) for k, v in recorded.items() if k.startswith("RAGLINE_TLS_")})


def read_state_address(path: Path, service: str) -> str | None:
    """Address of `service` recorded by a running `ragline up`, if any."""
    try:
        return json.loads(path.read_text())["services"][service]["address"]
    except (OSError, KeyError, ValueError):
        return None


def service_address(name: str, data_dir: Path) -> str:
    """Where a command finds `name`: RAGLINE_<NAME>_ADDR, else the running `ragline up`,
    else the default loopback layout."""
    variable = f"RAGLINE_{name.upper()}_ADDR"
    if os.environ.get(variable, "").strip():
        return os.environ[variable].strip()
    return read_state_address(data_dir / "up.json", name) or default_address(name)


def local_addresses(host: str = "127.0.0.1") -> dict[str, str]:
    """RAGLINE_<NAME>_ADDR of every registered service in the default loopback layout, for
    those the environment does not set already."""
    return {
        f"RAGLINE_{name.upper()}_ADDR": default_address(name, host)
        for name in service_names()
        if not os.environ.get(f"RAGLINE_{name.upper()}_ADDR", "").strip()
    }
