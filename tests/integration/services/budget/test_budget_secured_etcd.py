"""The budget ledger on an etcd that requires TLS with a client certificate and a user: the
budget service's user reaches its key prefix and nothing else, signs in again after etcd
forgot its tokens (a restart), and is refused, saying why, with a wrong password."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline_app.etcd_server import LedgerCredentials, provision_ledger_user
from ragline_app.stack import health_status
from support.budget import Api, budget_env, new_id

pytestmark = pytest.mark.integration

PREFIX = "/ragline/budget/v1"


@pytest.fixture
def secured_etcd(tls_etcd, tmp_path):
    server, certificates = tls_etcd
    credentials = LedgerCredentials.load_or_create(tmp_path / "etcd-credentials.json")
    asyncio.run(provision_ledger_user(server.endpoint, credentials, PREFIX, certificates))
    # a second run on the same data (`ragline up` again) changes nothing and fails nothing
    asyncio.run(provision_ledger_user(server.endpoint, credentials, PREFIX, certificates))
    return server, certificates, credentials


def secured_env(server, certificates, credentials, **extra) -> dict[str, str]:
    # By name, as a cluster gives it (a headless Service): gRPC's DNS resolver, and the
    # name checked in etcd's certificate.
    return budget_env(
        server,
        RAGLINE_BUDGET_ETCD_ENDPOINTS=f"localhost:{server.client_port}",
        RAGLINE_BUDGET_ETCD_CA_FILE=str(certificates.ca),
        RAGLINE_BUDGET_ETCD_CERT_FILE=str(certificates.service_cert),
        RAGLINE_BUDGET_ETCD_KEY_FILE=str(certificates.service_key),
        **{**credentials.budget_environment(), **extra},
    )


async def spend(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        api = Api(channel, "acme")
        task = new_id()
        await api.open(task, input_tokens=100)
        await api.reserve(task, "r1", input_tokens=40)
        await api.settle(task, "r1", input_tokens=30)
        ledger = await api.ledger(task)
        return ledger.used.input_tokens


async def wait_health(address: str, wanted: str, timeout_s: float = 20.0) -> str:
    status = ""
    for _ in range(int(timeout_s / 0.2)):
        status = await health_status(address, service="ragline.v1.BudgetService")
        if status == wanted:
            break
        await asyncio.sleep(0.2)
    return status


def test_the_ledger_works_through_tls_and_its_own_etcd_user(launcher, secured_etcd):
    server, certificates, credentials = secured_etcd
    budget = launcher.start("budget", env=secured_env(server, certificates, credentials))
    assert asyncio.run(spend(budget.address)) == 30

    async def outside_the_prefix() -> None:
        import etcd3aio

        tls = {
            "ca_cert": certificates.ca.read_bytes(),
            "cert_chain": certificates.service_cert.read_bytes(),
            "cert_key": certificates.service_key.read_bytes(),
        }
        async with etcd3aio.Etcd3Client([server.endpoint], **tls) as client:
            # without a token etcd now refuses everything
            with pytest.raises(etcd3aio.EtcdError):
                await client.kv.put(f"{PREFIX}/x", "1", timeout=5)
            reply = await client.auth.authenticate(
                credentials.username, credentials.password, timeout=5
            )
            client.set_token(reply.token)
            await client.kv.put(f"{PREFIX}/x", "1", timeout=5)
            # the budget's user reaches its ledger and nothing else
            with pytest.raises(etcd3aio.EtcdPermissionDeniedError):
                await client.kv.put("/ragline/other/x", "1", timeout=5)

    asyncio.run(outside_the_prefix())

    # etcd restarted forgets every token it issued: the ledger signs in again by itself
    server.stop()
    server.start()

    async def after_restart() -> int:
        # a few seconds to reconnect; then every call must go through again
        last = None
        for _ in range(100):
            try:
                return await spend(budget.address)
            except grpc.aio.AioRpcError as error:
                last = error
                await asyncio.sleep(0.2)
        raise AssertionError(f"no ledger write 20 s after etcd's restart: {last}")

    assert asyncio.run(after_restart()) == 30
    assert budget.process.poll() is None


def test_plaintext_or_a_wrong_password_is_refused_and_health_says_so(launcher, secured_etcd):
    server, certificates, credentials = secured_etcd
    wrong = launcher.start(
        "budget",
        env=secured_env(
            server, certificates, credentials, RAGLINE_BUDGET_ETCD_PASSWORD="not-the-password"
        ),
        wait=False,
    )
    plaintext = launcher.start(
        "budget",
        env=budget_env(server, **credentials.budget_environment()),
        wait=False,
    )

    async def checks() -> None:
        for handle in (wrong, plaintext):
            # started, and not ready: it answers nothing it cannot write down
            assert await wait_health(handle.address, "NOT_SERVING") == "NOT_SERVING"
            async with grpc.aio.insecure_channel(handle.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await Api(channel, "acme").open(new_id(), input_tokens=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                if handle is wrong:
                    assert "refused the budget service's credentials" in refused.value.details()
                    assert "ragline-budget" not in refused.value.details()  # for the log

    asyncio.run(checks())
    assert '"event": "budget.etcd_refused"' in wrong.log()
    assert "RAGLINE_BUDGET_ETCD_PASSWORD" in wrong.log()


def test_the_setup_command_secures_an_etcd_and_the_ledger_then_works(launcher, tls_etcd):
    """`ragline etcd-setup` (the chart's setup Job) on a fresh TLS etcd: auth on, the budget
    service's user confined to its prefix; run again, it changes nothing and succeeds."""
    import os
    import subprocess
    import sys

    server, certificates = tls_etcd
    credentials = LedgerCredentials("root-secret", "ledger", "ledger-secret")
    env = secured_env(server, certificates, credentials, RAGLINE_ETCD_ROOT_PASSWORD="root-secret")
    try:
        for _ in range(2):
            setup = subprocess.run(
                [sys.executable, "-m", "ragline_app.cli", "etcd-setup", "--wait", "30"],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert setup.returncode == 0, setup.stderr
            assert "auth on; user 'ledger'" in setup.stdout
        budget = launcher.start("budget", env=env)
        assert asyncio.run(spend(budget.address)) == 30
        wrong = launcher.start(
            "budget", env={**env, "RAGLINE_BUDGET_ETCD_PASSWORD": "nope"}, wait=False
        )
        assert asyncio.run(wait_health(wrong.address, "NOT_SERVING")) == "NOT_SERVING"
    finally:
        launcher.stop_all()
