"""TLS and mutual TLS on a real service process: who gets in, a plaintext health port for
probes, and certificates replaced on disk taking effect without a restart."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragline import tls as tls_module
from ragline.clients import ChannelPool, open_channel
from ragline.processes import free_ports
from ragline.tls import TlsConfig
from ragline.v1 import budget_pb2, budget_pb2_grpc
from ragline_app.certificates import local_authority

pytestmark = pytest.mark.integration


def replace_file(source: Path, target: Path) -> None:
    """As a Secret update does: the new content appears at once, never half-written."""
    staged = target.with_suffix(".staged")
    shutil.copyfile(source, staged)
    os.replace(staged, target)


async def health(address: str, tls: TlsConfig) -> str:
    async with open_channel(address, tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_mtls_admits_only_certified_clients_and_reloads_rotated_certificates(
    launcher, etcd, tmp_path
):
    first = local_authority(tmp_path / "first")
    second = local_authority(tmp_path / "second")
    # The files the service reads: a copy, so that the test can replace them.
    served = tmp_path / "served"
    served.mkdir()
    for name in ("service.crt", "service.key", "ca.crt"):
        shutil.copyfile(first.folder / name, served / name)
    health_port = free_ports(1)[0]
    env = {
        "RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint,
        "RAGLINE_TLS_MODE": "mtls",
        "RAGLINE_TLS_CERT_FILE": str(served / "service.crt"),
        "RAGLINE_TLS_KEY_FILE": str(served / "service.key"),
        "RAGLINE_TLS_CA_FILE": str(served / "ca.crt"),
        "RAGLINE_BUDGET_HEALTH_PORT": str(health_port),
    }
    handle = launcher.start("budget", env=env)
    address = handle.address

    def client(authority, ca=None, certified=True) -> TlsConfig:
        return TlsConfig(
            mode="mtls" if certified else "tls",
            cert_file=authority.client_cert,
            key_file=authority.client_key,
            ca_file=ca or authority.ca,
        )

    async def checks() -> None:
        certified = client(first)
        assert await health(address, certified) == "SERVING"
        # What the service answers beyond health goes over the same handshake.
        async with open_channel(address, certified) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await budget_pb2_grpc.BudgetServiceStub(channel).GetLedger(
                    budget_pb2.GetLedgerRequest(task_id="no-such-task"),
                    timeout=5,
                    metadata=(("x-ragline-tenant", "acme"),),
                )
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert await health(address, TlsConfig(mode="off")) == "UNAVAILABLE"
        assert await health(address, client(first, certified=False)) == "UNAVAILABLE"
        # A certificate from another CA is no certificate.
        assert await health(address, client(second, ca=first.ca)) == "UNAVAILABLE"
        # Probes that cannot speak TLS: the health port, plaintext, health only.
        plain = f"127.0.0.1:{health_port}"
        assert await health(plain, TlsConfig(mode="off")) == "SERVING"
        async with grpc.aio.insecure_channel(plain) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
                await budget_pb2_grpc.BudgetServiceStub(channel).GetLedger(
                    budget_pb2.GetLedgerRequest(task_id="t"), timeout=5
                )
            assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED

        # Half a rotation (the second CA's key beside the first CA's certificate): the
        # service keeps its last good pair.
        replace_file(second.service_key, served / "service.key")
        assert await health(address, certified) == "SERVING"
        # The whole rotation: new connections get the second CA's certificate, with no
        # restart (clients keep the first CA's client certificates: the CA file that
        # admits them is unchanged).
        replace_file(second.service_cert, served / "service.crt")
        assert await health(address, client(first, ca=second.ca)) == "SERVING"
        assert await health(address, certified) == "UNAVAILABLE"

    asyncio.run(checks())
    log = handle.log()
    assert '"event": "tls.reload_failed"' in log
    assert '"event": "tls.reloaded"' in log
    assert handle.process.poll() is None


def test_a_client_pool_reads_a_replaced_ca_without_a_restart(launcher, etcd, tmp_path, monkeypatch):
    """The pool of every service's outbound calls: a channel made before its files changed
    is replaced by one with the new credentials."""
    served = local_authority(tmp_path / "served")
    stale = local_authority(tmp_path / "stale")
    handle = launcher.start(
        "budget",
        env={
            "RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint,
            **served.service_environment("tls"),
        },
    )
    trusted = tmp_path / "trusted-ca.crt"
    shutil.copyfile(stale.ca, trusted)
    monkeypatch.setattr(tls_module, "CLIENT_RECHECK_S", 0.0)
    pool = ChannelPool(TlsConfig(mode="tls", ca_file=trusted))

    async def check(expected: str) -> None:
        stub = health_pb2_grpc.HealthStub(pool.get(handle.address))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as error:
            status = error.code().name
        assert status == expected

    async def checks() -> None:
        await check("UNAVAILABLE")
        replace_file(served.ca, trusted)
        await check("SERVING")
        await pool.close()

    asyncio.run(checks())


def test_a_service_refuses_to_start_without_the_files_tls_needs(launcher, tmp_path):
    authority = local_authority(tmp_path / "pki")
    with pytest.raises(AssertionError, match="RAGLINE_TLS_KEY_FILE"):
        launcher.start(
            "rerank",
            env={"RAGLINE_TLS_MODE": "tls", "RAGLINE_TLS_CERT_FILE": str(authority.service_cert)},
        )
    launcher.handles.clear()  # it exited by itself
