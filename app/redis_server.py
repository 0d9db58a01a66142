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


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError(
            "no redis-server on PATH: `apt-get install redis-server` (Debian), as .ci/run does"
        )
    return found


class RedisServer:
    def __init__(self, data_dir: Path, port: int, *, host: str = "127.0.0.1") -> None:
        self.data_dir = data_dir
        self.port = port
        self.host = host
        self.log_path = data_dir / "redis.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        return [
            redis_binary(),
            "--bind", self.host, "--port", str(self.port),
            "--dir", str(self.data_dir),
            # a cache: nothing to persist, and no fork for snapshots
            "--save", "", "--appendonly", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.log_path),
        ]  # fmt: skip

    def start(self, wait_s: float = 15.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        wait_listening(
            self.process, self.host, self.port, wait_s=wait_s, name="redis-server",
            log=self.log_path,
        )  # fmt: skip

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is not None:
            terminate(self.process, timeout_s)
            self.process = None
