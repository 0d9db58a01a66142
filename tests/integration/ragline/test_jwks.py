"""Client tokens verified with an identity provider's key set (RAGLINE_AUTH_JWKS_URL) by a
real service: the key a token's `kid` names, a rotation picked up without a restart, and
the refusals (unknown key, another key under a known id, no kid, algorithm confusion,
expired, another audience)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import http.server
import json
import threading
import time

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from ragline.auth import mint_token
from ragline.v1 import budget_pb2, budget_pb2_grpc
from support import error_info

pytestmark = pytest.mark.integration


class KeySetServer:
    """An identity provider's JWKS endpoint on loopback, whose keys the test changes."""

    def __init__(self) -> None:
        self.document = {"keys": []}
        self.fetches = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                owner.fetches += 1
                body = json.dumps(owner.document).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/.well-known/jwks.json"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(self, keys: dict[str, ec.EllipticCurvePrivateKey]) -> None:
        entries = []
        for kid, key in keys.items():
            entry = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
            entries.append({**entry, "kid": kid, "use": "sig", "alg": "ES256"})
        self.document = {"keys": entries}


def signed(key, kid: str | None, *, ttl_s=600, audience="ragline", algorithm="ES256") -> str:
    now = int(time.time())
    claims = {"tenant": "acme", "sub": "ana", "aud": audience, "iat": now, "exp": now + ttl_s}
    headers = {"kid": kid} if kid else {}
    return jwt.encode(claims, key, algorithm=algorithm, headers=headers)


def hs256_by_hand(secret: str, claims: dict) -> str:
    """An HS256 token keyed with `secret` (PyJWT refuses to sign with a JWK's text, which
    is the attack: so the token is made by hand)."""

    def part(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    header = part(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "first"}).encode())
    payload = part(json.dumps(claims).encode())
    mac = hmac.new(secret.encode(), f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{part(mac)}"


async def outcome(address: str, token: str) -> str:
    """OK when the call got past authentication (the task does not exist: NOT_FOUND), else
    the refusal's code and ErrorInfo reason."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await budget_pb2_grpc.BudgetServiceStub(channel).GetLedger(
                budget_pb2.GetLedgerRequest(task_id="no-such-task"),
                timeout=10,
                metadata=(("authorization", f"Bearer {token}"),),
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return "OK"
            return f"{error.code().name} {error_info(error)[0]}"
    return "OK"


def test_tokens_are_verified_with_the_key_their_kid_names_and_rotations_need_no_restart(
    launcher, etcd
):
    first, second = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    provider = KeySetServer()
    provider.publish({"first": first})
    budget = launcher.start(
        "budget",
        env={
            "RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint,
            "RAGLINE_AUTH_MODE": "jwt",
            "RAGLINE_AUTH_JWKS_URL": provider.url,
            # the shortest refresh allowed: a retired key disappears within it
            "RAGLINE_AUTH_JWKS_REFRESH_S": "10",
            "RAGLINE_AUTH_JWT_ALGORITHMS": "HS256,ES256",
            "RAGLINE_AUTH_SERVICE_KEY": "s" * 40,
        },
    )

    async def checks() -> None:
        address = budget.address
        assert await outcome(address, signed(first, "first")) == "OK"
        # a key the set does not hold yet: refused now, with the reason to retry
        assert await outcome(address, signed(second, "second")) == (
            "UNAUTHENTICATED UNKNOWN_SIGNING_KEY"
        )
        # another key under a known id, no id, expired, another audience
        assert (await outcome(address, signed(second, "first"))).startswith("UNAUTHENTICATED")
        assert (await outcome(address, signed(first, None))).startswith("UNAUTHENTICATED")
        assert await outcome(address, signed(first, "first", ttl_s=-120)) == (
            "UNAUTHENTICATED TOKEN_EXPIRED"
        )
        wrong_audience = signed(first, "first", audience="another")
        assert (await outcome(address, wrong_audience)).startswith("UNAUTHENTICATED")
        # algorithm confusion: HS256 keyed with the published key's own JWK text
        published = json.dumps(provider.document["keys"][0])
        confused = hs256_by_hand(
            published, {"tenant": "acme", "aud": "ragline", "exp": int(time.time()) + 600}
        )
        assert (await outcome(address, confused)).startswith("UNAUTHENTICATED")
        # an HMAC token as the laptop mode makes them: no HMAC key here
        laptop = mint_token("s" * 40, "acme")
        assert (await outcome(address, laptop)).startswith("UNAUTHENTICATED")

        # The provider rotates: the new key is published; the refusal above asked for a
        # fetch, which comes within the minimum gap between fetches (10 s).
        provider.publish({"first": first, "second": second})
        deadline = time.monotonic() + 30
        while await outcome(address, signed(second, "second")) != "OK":
            assert time.monotonic() < deadline, "the rotated key was never fetched"
            await asyncio.sleep(0.5)
        # ... and the retired key stops verifying once it is gone from the set
        provider.publish({"second": second})
        deadline = time.monotonic() + 30
        while await outcome(address, signed(first, "first")) == "OK":
            assert time.monotonic() < deadline, "the retired key kept verifying"
            await asyncio.sleep(0.5)

    asyncio.run(checks())
    assert budget.process.poll() is None
    assert provider.fetches >= 3
