"""Runs the real `tritonserver` 2.51 binary that PyPI `nvidia-pytriton` ships, CPU only.

For tests and laptops; production runs NVIDIA's Triton container on GPU nodes. The server
lives in its own virtualenv (pytriton needs numpy<2): `make triton-env` builds it at
`.venv-triton` (or RAGLINE_TRITON_VENV). Three things must be right for the python backend,
each seen failing here:
- the stub links the system libpython3.11: LD_LIBRARY_PATH must start with the running
  interpreter's own lib folder (else `_thread.RLock ... _recursion_count` errors), plus
  `nvidia_pytriton.libs` for its libcudart;
- the stub finds site-packages through `python` on PATH (it ignores PYTHONPATH): the venv's
  bin must come first, or it loads another numpy and silently corrupts tensors;
- a backend folder must hold libtriton_python.so, triton_python_backend_utils.py and the
  3.11 stub together.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ragline.config import CommonConfig
from ragline.processes import terminate
from ragline_app.certificates import LocalCertificates


def triton_venv() -> Path:
    return CommonConfig().triton_venv.resolve()


class TritonServer:
    def __init__(
        self,
        model_repository: Path,
        work_dir: Path,
        *,
        grpc_port: int,
        http_port: int,
        metrics_port: int,
        venv: Path | None = None,
        certificates: LocalCertificates | None = None,
    ) -> None:
        """`certificates`: gRPC under mutual TLS (the service certificate; clients with one
        the CA signed); HTTP, which health checks use, stays plaintext on loopback."""
        self.certificates = certificates
        self.model_repository = model_repository
        self.work_dir = work_dir
        self.grpc_port = grpc_port
        self.http_port = http_port
        self.metrics_port = metrics_port
        self.venv = venv or triton_venv()
        self.log_path = work_dir / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _site_packages(self) -> Path:
        found = list((self.venv / "lib").glob("python3*/site-packages"))
        if not found or not (found[0] / "pytriton").exists():
            raise FileNotFoundError(
                f"no nvidia-pytriton in {self.venv}: run `make triton-env` (or set "
                "RAGLINE_TRITON_VENV)"
            )
        return found[0]

    def _backends(self, site: Path) -> Path:
        server = site / "pytriton" / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        python_backend = self.work_dir / "backends" / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for source in (
            server / "backends" / "python" / "libtriton_python.so",
            server / "backends" / "python" / "triton_python_backend_utils.py",
            server / "python_backend_stubs" / version / "triton_python_backend_stub",
        ):
            target = python_backend / source.name
            if not target.exists():
                shutil.copy2(source, target)
        return self.work_dir / "backends"

    def environment(self, site: Path) -> dict[str, str]:
        venv_python = self.venv / "bin" / "python"
        base_prefix = subprocess.run(
            [str(venv_python), "-c", "import sys; print(sys.base_prefix)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        env = dict(os.environ)
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = f"{base_prefix}/lib:{site / 'nvidia_pytriton.libs'}"
        env.pop("PYTHONPATH", None)
        return env

    def start(self, wait_s: float = 90.0) -> None:
        site = self._site_packages()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        command = [
            str(site / "pytriton" / "tritonserver" / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self._backends(site)}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            "--http-address=127.0.0.1", f"--http-port={self.http_port}",
            "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--exit-on-error=true",
        ]  # fmt: skip
        if self.certificates is not None:
            command += [
                "--grpc-use-ssl=true",
                f"--grpc-server-cert={self.certificates.service_cert}",
                f"--grpc-server-key={self.certificates.service_key}",
                f"--grpc-root-cert={self.certificates.ca}",
                "--grpc-use-ssl-mutual=true",
            ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(site),
                cwd=self.work_dir,
            )
        self.wait_ready(wait_s)

    def wait_ready(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"tritonserver not ready after {wait_s} s:\n{self.log_tail()}")

    def model_ready(self, model: str) -> bool:
        url = f"http://127.0.0.1:{self.http_port}/v2/models/{model}/ready"
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metadata(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2", timeout=2) as reply:
            return json.loads(reply.read())

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.process is None:
            return None
        return terminate(self.process, timeout_s)[0]
