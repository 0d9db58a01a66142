"""The bundled Redis's users as the chart renders them, loaded by a real redis-server: the
user the services sign in as gets in with redis.password, the default user is off, and only
the pods that cache receive the password."""

from __future__ import annotations

import asyncio

import pytest

from ragline.cache import RedisAccess, open_cache
from ragline.errors import Unavailable
from ragline.processes import free_ports
from ragline_app.redis_server import RedisServer
from support.helm_chart import CHART, KEYS, OPEN, config_map, render, secret_holders, template

pytestmark = pytest.mark.deploy

PASSWORD = "a-cache-password"
SECURED = ["--set", f"redis.password={PASSWORD}", "--set", "config.RAGLINE_REDIS_USERNAME=ragline"]


def test_the_rendered_users_admit_the_services_user_only(helm, tmp_path):
    objects = render(helm, CHART, *SECURED)
    (acl,) = [o for o in objects if o["metadata"]["name"] == "rl-redis-acl"]
    assert PASSWORD not in acl["stringData"]["users.acl"]  # its sha256 only
    (tmp_path / "users.acl").write_text(acl["stringData"]["users.acl"])
    server = RedisServer(tmp_path / "redis", free_ports(1)[0])
    server.start_with(["--aclfile", str(tmp_path / "users.acl")])

    async def checks() -> None:
        user = open_cache(server.url, access=RedisAccess(username="ragline", password=PASSWORD))
        anonymous = open_cache(server.url)
        try:
            await user.set("k", b"v", ttl_s=30)
            assert await user.get("k") == b"v"
            with pytest.raises(Unavailable):
                await anonymous.get("k")
        finally:
            await user.close()
            await anonymous.close()

    try:
        asyncio.run(checks())
    finally:
        server.stop()

    assert secret_holders(objects, "rl-redis-client") == {"rl-orchestrator", "rl-generation"}


def test_the_exporters_user_reads_redis_state_and_no_cached_entry(helm, tmp_path):
    """The exporter beside Redis signs in as its own user: what redis_exporter asks
    (INFO, CONFIG GET, SLOWLOG, LATENCY, CLIENT SETNAME) is allowed, reading or writing a
    key (a tenant's cached answer) is not. Without its password there is no exporter."""
    import redis

    exporter = ["--set", "redis.exporter.password=an-exporter-password"]
    objects = render(helm, CHART, *SECURED, *exporter)
    (acl,) = [o for o in objects if o["metadata"]["name"] == "rl-redis-acl"]
    (tmp_path / "users.acl").write_text(acl["stringData"]["users.acl"])
    server = RedisServer(tmp_path / "redis", free_ports(1)[0])
    server.start_with(["--aclfile", str(tmp_path / "users.acl")])
    try:
        services = redis.Redis(port=server.port, username="ragline", password=PASSWORD)
        services.set("tenant-answer", b"secret")
        reader = redis.Redis(port=server.port, username="exporter", password="an-exporter-password")
        reader.client_setname("redis_exporter")
        assert reader.ping() and "redis_version" in reader.info()
        assert reader.config_get("maxmemory")
        reader.slowlog_len()
        reader.execute_command("LATENCY", "LATEST")
        for forbidden in (lambda: reader.get("tenant-answer"), lambda: reader.set("k", b"v")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
        services.close()
        reader.close()
    finally:
        server.stop()
    (statefulset,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-redis"
    ]
    containers = {c["name"]: c for c in statefulset["spec"]["template"]["spec"]["containers"]}
    env = {e["name"]: e for e in containers["exporter"]["env"]}
    assert env["REDIS_USER"]["value"] == "exporter"
    readers = {
        (workload["metadata"]["name"], container["name"])
        for workload in objects
        if workload["kind"] in ("Deployment", "StatefulSet", "Job")
        for container in workload["spec"]["template"]["spec"]["containers"]
        for variable in container.get("env", [])
        if variable.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "rl-redis-exporter"
    }
    assert readers == {("rl-redis", "exporter")}  # its password reaches it alone
    # insecure, a password for the services' user and none for the exporter's (the chart
    # makes none): no exporter at all
    objects = render(helm, CHART, *SECURED, *OPEN)
    (statefulset,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-redis"
    ]
    names = [c["name"] for c in statefulset["spec"]["template"]["spec"]["containers"]]
    assert names == ["redis"]


def test_a_password_without_its_user_fails_with_what_to_set(helm):
    no_user = ["--set", "config.RAGLINE_REDIS_USERNAME="]
    result = template(helm, *KEYS, "--set", f"redis.password={PASSWORD}", *no_user)
    assert result.returncode != 0 and "config.RAGLINE_REDIS_USERNAME" in result.stderr


def test_the_rendered_redis_serves_tls_to_the_services_user(helm, tmp_path):
    """With RAGLINE_TLS_MODE on, the bundled Redis's rendered command line (its paths moved
    to this machine) runs a real redis-server that serves TLS only, to clients with a
    certificate of the CA, and the services' cache URL asks for TLS."""
    from ragline_app.certificates import local_authority

    tls = ["--set", "config.RAGLINE_TLS_MODE=mtls", "--set", "tls.secretName=ragline-tls"]
    objects = render(helm, CHART, *SECURED, *tls)
    config = config_map(objects)
    assert config["RAGLINE_ORCHESTRATOR_CACHE_URL"].startswith("rediss://rl-redis:")
    (redis,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-redis"
    ]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    (acl,) = [o for o in objects if o["metadata"]["name"] == "rl-redis-acl"]
    (tmp_path / "users.acl").write_text(acl["stringData"]["users.acl"])
    pki = local_authority(tmp_path / "pki")
    port = free_ports(1)[0]
    moved = {
        "/etc/redis/acl/users.acl": str(tmp_path / "users.acl"),
        "/etc/redis/tls/tls.crt": str(pki.service_cert),
        "/etc/redis/tls/tls.key": str(pki.service_key),
        "/etc/redis/tls/ca.crt": str(pki.ca),
        "6379": str(port),
    }
    # the rendered --port 0 / --tls-port replace the plain port the server class sets
    server = RedisServer(tmp_path / "redis", port)
    server.start_with([moved.get(a, a) for a in args])

    async def checks() -> None:
        url = f"rediss://127.0.0.1:{port}/0"
        services = RedisAccess(
            username="ragline",
            password=PASSWORD,
            ca_file=pki.ca,
            cert_file=pki.service_cert,
            key_file=pki.service_key,
        )
        uncertified = RedisAccess(username="ragline", password=PASSWORD, ca_file=pki.ca)
        caches = [open_cache(url, access=services), open_cache(url, access=uncertified)]
        plain = open_cache(
            f"redis://127.0.0.1:{port}/0",
            timeout_s=1.0,
            access=RedisAccess(username="ragline", password=PASSWORD),
        )
        try:
            await caches[0].set("k", b"v", ttl_s=30)
            assert await caches[0].get("k") == b"v"
            for refused in (caches[1], plain):
                with pytest.raises(Unavailable):
                    await refused.get("k")
        finally:
            for cache in [*caches, plain]:
                await cache.close()

    try:
        asyncio.run(checks())
    finally:
        server.stop()
