"""The chart secure as it stands (issue 57): an install with no security values set runs
mutual TLS on certificates the chart makes (a real service serves them, a client without
one is refused), etcd with TLS and auth, Redis and Qdrant with credentials made at install
(a real redis-server admits the made password only); an open install needs `insecure`,
and is refused with what to set without it."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import pytest

from ragline.cache import RedisAccess, open_cache
from ragline.errors import Unauthenticated, Unavailable
from ragline.processes import free_ports
from ragline.tls import TlsConfig
from ragline_app.redis_server import RedisServer
from ragline_app.stack import health_status_sync
from support.budget import budget_env
from support.helm_chart import (
    CHART,
    KEYS,
    OPEN,
    config_map,
    pod_spec,
    render,
    secret_holders,
    template,
    workloads,
)

pytestmark = pytest.mark.deploy


def secret(objects: list[dict], name: str) -> dict[str, str]:
    """A Secret's values, decoded."""
    (found,) = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == name]
    decoded = {k: base64.b64decode(v).decode() for k, v in found.get("data", {}).items()}
    return {**decoded, **found.get("stringData", {})}


def made_credentials(objects: list[dict]) -> dict[str, str]:
    return {
        "redis": secret(objects, "rl-redis-client")["RAGLINE_REDIS_PASSWORD"],
        "exporter": secret(objects, "rl-redis-exporter")["REDIS_PASSWORD"],
        "etcd root": secret(objects, "rl-etcd-root")["RAGLINE_ETCD_ROOT_PASSWORD"],
        "etcd budget": secret(objects, "rl-budget-etcd")["RAGLINE_BUDGET_ETCD_PASSWORD"],
        "qdrant": secret(objects, "rl-qdrant-key")["RAGLINE_RETRIEVAL_QDRANT_API_KEY"],
        "qdrant metrics": secret(objects, "rl-qdrant-metrics-key")["apiKey"],
    }


def test_an_install_as_it_stands_is_secured(helm):
    objects = render(helm, CHART, "--set", "qdrant.enabled=true")
    config = config_map(objects)
    assert config["RAGLINE_TLS_MODE"] == "mtls" and config["RAGLINE_AUTH_MODE"] == "jwt"
    # The chart's own certificate, mounted by every ragline pod; its CA's key by none.
    assert set(secret(objects, "rl-tls")) == {"ca.crt", "tls.crt", "tls.key"}
    assert set(secret(objects, "rl-tls-ca")) == {"ca.crt", "ca.key"}
    assert not secret_holders(objects, "rl-tls-ca")
    mounting = {
        w["metadata"]["name"]
        for w in workloads(objects)
        for v in pod_spec(w).get("volumes", [])
        if v.get("secret", {}).get("secretName") == "rl-tls-ca"
    }
    assert not mounting
    # Every store's credential made, long, and each one different.
    made = made_credentials(objects)
    assert all(len(value) >= 32 for value in made.values()), made
    assert len(set(made.values())) == len(made)
    acl = secret(objects, "rl-redis-acl")["users.acl"]
    assert "user default off" in acl
    assert hashlib.sha256(made["redis"].encode()).hexdigest() in acl
    assert config["RAGLINE_REDIS_USERNAME"] == "ragline"
    assert config["RAGLINE_BUDGET_ETCD_USERNAME"] == "ragline-budget"
    (etcd,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-etcd"
    ]
    assert "--client-cert-auth" in pod_spec(etcd)["containers"][0]["args"]
    assert [o for o in objects if o["kind"] == "Job" and o["metadata"]["name"] == "rl-etcd-setup"]


def test_an_operators_values_win_over_made_ones(helm):
    objects = render(helm, CHART, "--set", "redis.password=mine", "--set", "tls.secretName=ops")
    assert secret(objects, "rl-redis-client")["RAGLINE_REDIS_PASSWORD"] == "mine"
    assert not [o for o in objects if o["metadata"]["name"] in ("rl-tls", "rl-tls-ca")]


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (["--set", "config.RAGLINE_TLS_MODE=off"], "RAGLINE_TLS_MODE is off"),
        (["--set", "config.RAGLINE_AUTH_MODE=off"], "RAGLINE_AUTH_MODE is not jwt"),
        (["--set", "etcd.secure=false"], "etcd.secure is false"),
    ],
)
def test_an_open_install_is_refused_without_insecure(helm, values, says):
    refused = template(helm, *KEYS, *values)
    assert refused.returncode != 0
    assert says in refused.stderr and "insecure: true" in refused.stderr
    allowed = template(helm, *KEYS, *values, *OPEN)
    assert allowed.returncode == 0, allowed.stderr


def test_an_insecure_install_makes_no_credential(helm):
    objects = render(helm, CHART, *OPEN, "--set", "qdrant.enabled=true")
    assert secret(objects, "rl-redis-client")["RAGLINE_REDIS_PASSWORD"] == ""
    assert secret(objects, "rl-qdrant-key")["RAGLINE_RETRIEVAL_QDRANT_API_KEY"] == ""
    assert config_map(objects)["RAGLINE_REDIS_USERNAME"] == ""


def test_the_charts_certificate_serves_mutual_tls_to_a_real_service(helm, launcher, etcd, tmp_path):
    """The certificate the chart makes, as a pod mounts it, runs a real service under
    mtls by the name its Service gives it; a client without a certificate of that CA is
    refused."""
    files = secret(render(helm), "rl-tls")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    tls = {
        "RAGLINE_TLS_MODE": "mtls",
        "RAGLINE_TLS_CERT_FILE": str(tmp_path / "tls.crt"),
        "RAGLINE_TLS_KEY_FILE": str(tmp_path / "tls.key"),
        "RAGLINE_TLS_CA_FILE": str(tmp_path / "ca.crt"),
        "RAGLINE_TLS_SERVER_NAME": "rl-budget.default.svc",  # a name the pod is dialled by
    }
    budget = launcher.start("budget", env={**tls, **budget_env(etcd)})
    assert health_status_sync(budget.address, timeout_s=5, tls=budget.tls) == "SERVING"
    without_certificate = TlsConfig(
        mode="tls", ca_file=tmp_path / "ca.crt", server_name="rl-budget.default.svc"
    )
    assert health_status_sync(budget.address, timeout_s=5, tls=without_certificate) != "SERVING"
    another_name = TlsConfig(**{**budget.tls.model_dump(), "server_name": "rl-elsewhere"})
    assert health_status_sync(budget.address, timeout_s=5, tls=another_name) != "SERVING"


def test_the_made_redis_password_is_the_only_way_in(helm, tmp_path):
    objects = render(helm)
    password = secret(objects, "rl-redis-client")["RAGLINE_REDIS_PASSWORD"]
    (tmp_path / "users.acl").write_text(secret(objects, "rl-redis-acl")["users.acl"])
    server = RedisServer(tmp_path / "redis", free_ports(1)[0])
    server.start_with(["--aclfile", str(tmp_path / "users.acl")])

    async def checks() -> None:
        user = open_cache(server.url, access=RedisAccess(username="ragline", password=password))
        anonymous = open_cache(server.url)
        guessed = open_cache(server.url, access=RedisAccess(username="ragline", password="x"))
        try:
            await user.set("k", b"v", ttl_s=30)
            assert await user.get("k") == b"v"
            for outsider in (anonymous, guessed):
                with pytest.raises(Unavailable):
                    await outsider.get("k")
        finally:
            for cache in (user, anonymous, guessed):
                await cache.close()

    try:
        asyncio.run(checks())
    finally:
        server.stop()


def test_each_service_signs_with_its_own_key_and_holds_no_other(helm, tmp_path):
    """The keys the chart makes, as the pods mount them: each service's private key
    reaches its own pods only, its credential verifies as that service with the public
    keys every pod mounts, and one service's key cannot speak for another."""
    from ragline.auth import AuthConfig, Authenticator, ServiceCredential

    objects = render(helm)
    names = ("budget", "embedding", "generation", "orchestrator", "rerank", "retrieval")
    for workload in workloads(objects):
        volumes = pod_spec(workload).get("volumes", [])
        keys = {
            v["secret"]["secretName"]
            for v in volumes
            if v.get("secret", {}).get("secretName", "").endswith("-service-key")
        }
        label = workload["metadata"].get("labels", {}).get("app.kubernetes.io/name")
        if label in names:
            assert keys == {f"rl-{label}-service-key"}, workload["metadata"]["name"]
        else:
            assert not keys, workload["metadata"]["name"]
    (public,) = [o for o in objects if o["metadata"]["name"] == "rl-service-public-keys"]
    (tmp_path / "public").mkdir()
    for file, pem in public["data"].items():
        (tmp_path / "public" / file).write_text(pem)
    assert sorted(public["data"]) == sorted(f"{n}.pem" for n in names)

    def config(name: str) -> AuthConfig:
        private = tmp_path / f"{name}.pem"
        private.write_text(secret(objects, f"rl-{name}-service-key")["key.pem"])
        return AuthConfig(
            mode="jwt",
            jwt_key="k",
            service_private_key_file=private,
            service_public_keys_dir=tmp_path / "public",
        )

    generation = Authenticator(config("generation"))
    orchestrator = ServiceCredential(config("orchestrator"), "orchestrator")
    assert generation.authenticate(orchestrator.metadata()).service == "orchestrator"
    posing = ServiceCredential(config("retrieval"), "orchestrator")
    with pytest.raises(Unauthenticated):
        generation.authenticate(posing.metadata())
    assert (
        config_map(objects)["RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR"] == "/etc/ragline/service-keys"
    )
