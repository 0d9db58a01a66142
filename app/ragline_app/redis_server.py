"""A local Redis for the tests and benchmarks of the shared cache backend.

The binary is Debian's `redis-server` (`.ci/run` installs it). Production points a service
at its own Redis with RAGLINE_<SERVICE>_CACHE_URL; `ragline up` needs none (the cache is
in-process when embedded).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ragline.processes import terminate, wait_listening
from ragline_app.certificates import LocalCertificates


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError(
            "no redis-server on PATH: `apt-get install redis-server` (Debian), as .ci/run does"
        )
    return found


class RedisServer:
    def __init__(
        self,
        data_dir: Path,
        port: int,
        *,
        host: str = "127.0.0.1",
        users: dict[str, str] | None = None,
        certificates: LocalCertificates | None = None,
    ) -> None:
        """`users`: ACL users (name -> password) that may use every key and command but
        the administrative ones; the passwordless `default` user is then off.
        `certificates`: TLS only on `port`, clients presenting a certificate of the CA."""
        self.data_dir = data_dir
        self.port = port
        self.host = host
        self.users = users or {}
        self.certificates = certificates
        self.log_path = data_dir / "redis.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.certificates is not None else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        command = [
            redis_binary(),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            # a cache: nothing to persist, and no fork for snapshots
            "--save", "", "--appendonly", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        if self.certificates is None:
            command += ["--port", str(self.port)]
        else:
            command += [
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.certificates.service_cert),
                "--tls-key-file", str(self.certificates.service_key),
                "--tls-ca-cert-file", str(self.certificates.ca),
                "--tls-auth-clients", "yes",
            ]  # fmt: skip
        if self.users:
            command += ["--user", "default", "off"]
            for name, password in self.users.items():
                # ACL rules as separate words of one --user directive
                command += ["--user", name, "on", f">{password}", "~*", "&*", "+@all",
                            "-@admin", "-@dangerous"]  # fmt: skip
        return command

    def start(self, wait_s: float = 15.0) -> None:
        self.start_with([], wait_s)

    def start_with(self, extra: list[str], wait_s: float = 15.0) -> None:
        """Starts it with more of redis-server's options (a test's ACL file)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [*self.command(), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        wait_listening(
            self.process,
            self.host,
            self.port,
            wait_s=wait_s,
            name="redis-server",
            log=self.log_path,
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            terminate(self.process, timeout_s)
            self.process = None
