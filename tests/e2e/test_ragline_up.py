"""`ragline up` as a user runs it: six services, grpcurl on each, Ctrl-C stops all cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from ragline_services.registry import http_service_names, load_spec, service_names
from support import SMALL_GENERATION

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent


def read_until(process: subprocess.Popen, marker: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} within {timeout_s} s; output so far:\n" + "\n".join(lines))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_six_services_and_ctrl_c_stops_them(tmp_path, grpcurl_bin):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **SMALL_GENERATION}
    process = subprocess.Popen(
        [str(BIN / "ragline"), "up", "--base-port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = read_until(process, "ragline up: ready", timeout_s=120)
        addresses, metrics = {}, {}
        for line in lines:
            match = re.match(
                r"^\s+(\w+)\s+(127\.0\.0\.1:\d+)\s+SERVING\s+metrics (http://\S+/metrics)$",
                line,
            )
            if match:
                addresses[match.group(1)] = match.group(2)
                metrics[match.group(1)] = match.group(3)
        every = {*service_names(), *http_service_names()}
        assert set(addresses) == set(metrics) == every
        models = httpx.get(f"http://{addresses['gateway']}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"], models.text

        for name, address in addresses.items():
            if name not in service_names():
                continue
            listed = subprocess.run(
                [grpcurl_bin, "-plaintext", address, "list"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert listed.returncode == 0, listed.stderr
            assert load_spec(name).grpc_service in listed.stdout.split()
            assert "grpc.health.v1.Health" in listed.stdout
            assert "grpc.reflection.v1alpha.ServerReflection" in listed.stdout
            assert "grpc.reflection.v1.ServerReflection" in listed.stdout

        # `ragline health` finds the stack through the state file of `ragline up`.
        health = subprocess.run(
            [str(BIN / "ragline"), "health", "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert health.returncode == 0, health.stdout + health.stderr
        statuses = json.loads(health.stdout)
        assert {n: s["status"] for n, s in statuses.items()} == dict.fromkeys(every, "SERVING")
        state = json.loads((tmp_path / ".ragline" / "up.json").read_text())
        pids = [svc["pid"] for svc in state["services"].values()]
        # `ragline top` reads the metrics `ragline up` printed and recorded: one frame
        top = subprocess.run(
            [str(BIN / "ragline"), "top", "--frames", "1", "--interval", "0.5"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "160"},
        )
        assert top.returncode == 0, top.stderr
        drawn = {line.split()[1] for line in top.stdout.splitlines() if line.startswith("│")}
        assert every <= drawn, top.stdout
        assert "down" not in top.stdout, top.stdout

        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output
        assert "all services stopped cleanly" in output
        assert not any(pid_alive(pid) for pid in pids)
        assert not (tmp_path / ".ragline" / "up.json").exists()
        for name in every:
            log = (tmp_path / ".ragline" / "logs" / f"{name}.log").read_text()
            assert '"event": "service.stopped"' in log, name
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ask_without_a_running_stack_says_unavailable(tmp_path):
    result = subprocess.run(
        [
            str(BIN / "ragline"),
            "ask",
            "What is ragline?",
            "--addr",
            "127.0.0.1:1",
            "--timeout",
            "5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


async def refused_by_etcd(endpoint: str, pki: Path) -> None:
    import etcd3aio

    async with etcd3aio.Etcd3Client([endpoint]) as plain:
        with pytest.raises(etcd3aio.EtcdError):
            await plain.kv.get("/ragline/budget/v1/x", timeout=3)
    certified = {
        "ca_cert": (pki / "ca.crt").read_bytes(),
        "cert_chain": (pki / "service.crt").read_bytes(),
        "cert_key": (pki / "service.key").read_bytes(),
    }
    async with etcd3aio.Etcd3Client([endpoint], **certified) as no_user:
        with pytest.raises((etcd3aio.EtcdError, grpc.aio.AioRpcError)):
            await no_user.kv.get("/ragline/budget/v1/x", timeout=3)


@pytest.mark.full
def test_up_with_tls_answers_over_mutual_tls_and_refuses_plaintext(tmp_path, grpcurl_bin):
    """`ragline up --tls`: every hop (command -> orchestrator -> each service) under mTLS
    with a local CA; commands find the client certificate through the stack's state."""
    # The default models, as a user's `ragline up`: the 135M test model's answers to the
    # demo question are too often ungrounded to prove a path.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in [k for k in env if k.startswith("RAGLINE_TLS_")]:
        del env[key]
    process = subprocess.Popen(
        [str(BIN / "ragline"), "up", "--tls", "--base-port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def ragline(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ragline"), *args],
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def grpcurl(address: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [grpcurl_bin, *flags, address, "list"], capture_output=True, text=True, timeout=30
        )

    try:
        lines = read_until(process, "ragline up: ready", timeout_s=180)
        state = json.loads((tmp_path / ".ragline" / "up.json").read_text())
        client = state["tls"]
        assert client["RAGLINE_TLS_MODE"] == "mtls"
        certified = (
            *("-cacert", client["RAGLINE_TLS_CA_FILE"]),
            *("-cert", client["RAGLINE_TLS_CERT_FILE"]),
            *("-key", client["RAGLINE_TLS_KEY_FILE"]),
        )
        assert any(" ".join(certified) in line for line in lines), lines  # the hint says how
        gateway = state["services"].pop("gateway")
        # The HTTP gateway: HTTPS with the stack's certificate (its callers prove who they
        # are with tokens), nothing in plaintext.
        ca = ssl.create_default_context(cafile=client["RAGLINE_TLS_CA_FILE"])
        models = httpx.get(f"https://{gateway['address']}/v1/models", verify=ca, timeout=10)
        assert models.status_code == 200, models.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{gateway['address']}/v1/models", timeout=10)
        for name, entry in state["services"].items():
            assert grpcurl(entry["address"], "-plaintext").returncode != 0, name
            assert grpcurl(entry["address"], *certified[:2]).returncode != 0, name
            listed = grpcurl(entry["address"], *certified)
            assert listed.returncode == 0, (name, listed.stderr)
            assert load_spec(name).grpc_service in listed.stdout.split()

        # The demo corpus went in through TLS (`ragline up` is a client of the services).
        asked = ragline("ask", "Which river flows through Warsaw?")
        assert asked.returncode == 0, asked.stdout + asked.stderr
        assert "vistula" in asked.stdout.lower(), asked.stdout
        assert "[COMPLETE]" in asked.stdout and "Warsaw (squad_dev_sample:0:" in asked.stdout
        # The local etcd is secured as well: TLS with client certificates, and auth on.
        asyncio.run(refused_by_etcd(state["etcd"], tmp_path / ".ragline" / "tls"))
        # A command that speaks plaintext, or TLS without a certificate, gets nothing.
        plain = ragline("ask", "Which river flows through Warsaw?", RAGLINE_TLS_MODE="off")
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        uncertified = ragline(
            "ask",
            "Which river flows through Warsaw?",
            RAGLINE_TLS_MODE="tls",
            RAGLINE_TLS_CA_FILE=client["RAGLINE_TLS_CA_FILE"],
        )
        assert uncertified.returncode == 1 and "UNAVAILABLE" in uncertified.stderr

        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
