"""The shared cache on a Redis that requires TLS with a client certificate and an ACL user:
the service's user reaches it, a wrong password or plaintext is a cache miss (Unavailable)
that never shows the password, and a password in the URL is refused."""

from __future__ import annotations

import uuid

import pytest

from ragline.cache import RedisAccess, open_cache
from ragline.config import ConfigError
from ragline.errors import Unavailable
from ragline.processes import free_ports
from ragline_app.certificates import local_authority
from ragline_app.redis_server import RedisServer

pytestmark = pytest.mark.integration

PASSWORD = "cache-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secured-redis")
    certificates = local_authority(folder / "pki")
    server = RedisServer(
        folder / "redis", free_ports(1)[0], users={"ragline": PASSWORD}, certificates=certificates
    )
    server.start()
    yield server, certificates
    server.stop()


def access(certificates, **changes) -> RedisAccess:
    settings = {
        "username": "ragline",
        "password": PASSWORD,
        "ca_file": certificates.ca,
        "cert_file": certificates.service_cert,
        "key_file": certificates.service_key,
        **changes,
    }
    return RedisAccess(**settings)


async def test_the_services_user_reaches_the_cache_over_tls(secured_redis):
    server, certificates = secured_redis
    assert server.url.startswith("rediss://")
    cache = open_cache(server.url, access=access(certificates))
    try:
        await cache.set("test:secured", b"v", ttl_s=30)
        assert await cache.get("test:secured") == b"v"
        await cache.ping()
    finally:
        await cache.close()


@pytest.mark.parametrize(
    "case",
    ["wrong password", "no user", "no client certificate", "plaintext"],
)
async def test_refusals_are_misses_and_never_show_the_password(secured_redis, case):
    server, certificates = secured_redis
    url, settings = server.url, {}
    if case == "wrong password":
        settings = {"password": "not-" + PASSWORD}
    elif case == "no user":
        settings = {"username": "", "password": ""}
    elif case == "no client certificate":
        settings = {"cert_file": None, "key_file": None}
    else:
        url, settings = url.replace("rediss://", "redis://"), {"ca_file": None, "cert_file": None}
    cache = open_cache(url, timeout_s=2.0, access=access(certificates, **settings))
    try:
        with pytest.raises(Unavailable) as refused:
            await cache.get("test:secured")
        assert PASSWORD not in str(refused.value)
    finally:
        await cache.close()


def test_a_password_in_the_url_is_refused(secured_redis):
    server, _ = secured_redis
    with pytest.raises(ConfigError, match="RAGLINE_REDIS_PASSWORD"):
        open_cache(server.url.replace("rediss://", f"rediss://ragline:{PASSWORD}@"))
