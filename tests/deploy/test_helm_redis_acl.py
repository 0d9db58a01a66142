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
from support.helm_chart import CHART, render

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

    holders = {
        w["metadata"]["labels"]["app.kubernetes.io/name"]
        for w in objects
        if w["kind"] in ("Deployment", "StatefulSet")
        for source in w["spec"]["template"]["spec"]["containers"][0].get("envFrom", [])
        if source.get("secretRef", {}).get("name") == "rl-redis-client"
    }
    assert holders == {"orchestrator", "generation"}


def test_a_password_without_its_user_fails_with_what_to_set(helm):
    import subprocess

    from support.helm_chart import KEYS

    result = subprocess.run(
        [helm, "template", "rl", str(CHART), *KEYS, "--set", f"redis.password={PASSWORD}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "config.RAGLINE_REDIS_USERNAME" in result.stderr
