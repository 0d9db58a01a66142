"""Authentication on across all six services (RAGLINE_AUTH_MODE=jwt), as a client meets it:
`ragline ingest --token` and `ragline ask --token` through every service, health and
reflection open without a token, and tokens that must not pass refused at the front door:
wrong audience, expired, signed with another key, unsigned, without a tenant; a wrong or
missing issuer where one is configured; and an algorithm-confusion
forgery (HS256 keyed with a public key's PEM text)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

import grpc
import pytest

from ragline.auth import mint_token
from ragline.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from support import AUTH_CLIENT_KEY, AUTH_ENV, SQUAD_SAMPLE

pytestmark = pytest.mark.integration

RAGLINE = [sys.executable, "-m", "ragline_app.cli"]


def cli_env(stack, tmp_path) -> dict[str, str]:
    return {
        **os.environ,
        **AUTH_ENV,
        "RAGLINE_DATA_DIR": str(tmp_path),
        **{f"RAGLINE_{n.upper()}_ADDR": h.address for n, h in stack.items()},
    }


def test_ingest_and_ask_with_tokens_through_all_six_services(jwt_stack, tmp_path, grpcurl_bin):
    env = cli_env(jwt_stack, tmp_path)
    writer = mint_token(AUTH_CLIENT_KEY, "acme", principal="ana", scopes=["ragline:write"])
    ingested = subprocess.run(
        [*RAGLINE, "ingest", str(SQUAD_SAMPLE), "--token", writer],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ingested.returncode == 0, ingested.stdout + ingested.stderr
    assert "203" in ingested.stdout + ingested.stderr

    reader = mint_token(AUTH_CLIENT_KEY, "acme", principal="ana")
    asked = subprocess.run(
        [*RAGLINE, "ask", "Which river flows through Warsaw?", "--token", reader],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert "vistula" in asked.stdout.lower(), asked.stdout
    assert "[COMPLETE]" in asked.stdout and "Warsaw (squad_dev_sample:0:" in asked.stdout

    # Another tenant's token sees none of it: the same question has no evidence there.
    other = mint_token(AUTH_CLIENT_KEY, "globex", principal="bo")
    elsewhere = subprocess.run(
        [*RAGLINE, "ask", "Which river flows through Warsaw?", "--token", other],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "[COMPLETE]" not in elsewhere.stdout, elsewhere.stdout
    assert "Warsaw (squad_dev_sample" not in elsewhere.stdout


@pytest.mark.parametrize(
    "name", ["orchestrator", "embedding", "retrieval", "rerank", "generation", "budget"]
)
def test_health_and_reflection_answer_without_a_token(jwt_stack, grpcurl_bin, name):
    address = jwt_stack[name].address
    listed = subprocess.run(
        [grpcurl_bin, "-plaintext", "-max-time", "10", address, "list"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    health = subprocess.run(
        [grpcurl_bin, "-plaintext", "-max-time", "10", address, "grpc.health.v1.Health/Check"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert json.loads(health.stdout) == {"status": "SERVING"}, health.stderr


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hs256_forgery(secret: bytes, claims: dict) -> str:
    """An HS256 token signed by hand (PyJWT itself refuses a PEM as an HMAC secret)."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = _b64(json.dumps(claims).encode())
    signature = hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{_b64(signature)}"


def claims(**changes) -> dict:
    """The claims `mint_token` writes, changed."""
    now = int(time.time())
    made = {
        "tenant": "acme",
        "sub": "ana",
        "scopes": [],
        "aud": "ragline",
        "iat": now,
        "exp": now + 60,
    }
    made.update(changes)
    return {k: v for k, v in made.items() if v is not None}


async def ask_code(address: str, token: str) -> grpc.StatusCode:
    """OK when the Ask ran (whatever its answer), else the status it was refused with."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        call = stub.Ask(
            orchestrator_pb2.AskRequest(question="Which river flows through Warsaw?"),
            timeout=60,
            metadata=(("authorization", f"Bearer {token}"),),
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_tokens_that_must_not_pass_are_refused_at_the_front_door(jwt_stack):
    address = jwt_stack["orchestrator"].address
    key = AUTH_CLIENT_KEY.encode()
    # The hand-made signature is a real one: with the right key and claims it passes.
    assert await ask_code(address, hs256_forgery(key, claims())) == grpc.StatusCode.OK
    refused = {
        "another audience": hs256_forgery(key, claims(aud="someone-else")),
        "expired": hs256_forgery(key, claims(exp=int(time.time()) - 120)),
        "another key": hs256_forgery(b"not-the-key-" * 4, claims()),
        "no tenant": hs256_forgery(key, claims(tenant=None)),
        "unsigned": hs256_forgery(key, claims()).rsplit(".", 1)[0] + ".",
    }
    for why, token in refused.items():
        assert await ask_code(address, token) == grpc.StatusCode.UNAUTHENTICATED, why


async def test_an_hs256_token_keyed_with_the_public_keys_pem_is_refused(launcher, tmp_path):
    """Algorithm confusion: a service verifying ES256 tokens with a public key must not
    accept an HS256 token whose HMAC key is that public key's PEM text."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    private = ec.generate_private_key(ec.SECP256R1())
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "issuer.pem").write_bytes(pem)
    env = {
        "RAGLINE_AUTH_MODE": "jwt",
        "RAGLINE_AUTH_JWT_PUBLIC_KEY_FILE": str(tmp_path / "issuer.pem"),
        "RAGLINE_AUTH_SERVICE_KEY": AUTH_ENV["RAGLINE_AUTH_SERVICE_KEY"],
    }
    embedding = launcher.start("embedding", env=env)
    genuine = mint_token(private, "acme", principal="ana", algorithm="ES256")
    forged = hs256_forgery(pem, claims())
    request = embedding_pb2.EmbedRequest(texts=["Which river flows through Warsaw?"])
    async with grpc.aio.insecure_channel(embedding.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        reply = await stub.Embed(
            request, timeout=30, metadata=(("authorization", f"Bearer {genuine}"),)
        )
        assert reply.embeddings
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(request, timeout=30, metadata=(("authorization", f"Bearer {forged}"),))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_with_an_issuer_configured_only_its_tokens_pass(launcher):
    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    issuer = "https://id.example.com"
    embedding = launcher.start("embedding", env={**AUTH_ENV, "RAGLINE_AUTH_JWT_ISSUER": issuer})
    key = AUTH_CLIENT_KEY.encode()
    request = embedding_pb2.EmbedRequest(texts=["Which river flows through Warsaw?"])

    async def code(token: str) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(embedding.address) as channel:
            stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
            try:
                await stub.Embed(
                    request, timeout=30, metadata=(("authorization", f"Bearer {token}"),)
                )
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    assert await code(hs256_forgery(key, claims(iss=issuer))) == grpc.StatusCode.OK
    assert await code(hs256_forgery(key, claims(iss="https://evil.example.com"))) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    assert await code(hs256_forgery(key, claims())) == grpc.StatusCode.UNAUTHENTICATED


async def test_an_end_users_token_reaches_the_front_door_not_generation(jwt_stack):
    """Generation answers only other ragline services (an end user's call there would skip
    admission and the task budget); the same token asks the orchestrator, which calls
    generation with its own credential."""
    from ragline.v1 import generation_pb2, generation_pb2_grpc
    from support import error_reason

    token = (("authorization", f"Bearer {mint_token(AUTH_CLIENT_KEY, 'acme')}"),)
    async with grpc.aio.insecure_channel(jwt_stack["generation"].address) as channel:
        request = generation_pb2.GenerateRequest(prompt="Hi", max_tokens=1, light_tenant=True)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                request, timeout=30, metadata=token
            ):
                pass
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_reason(refused.value) == "CLIENT_TOKEN_NOT_ACCEPTED"
    async with grpc.aio.insecure_channel(jwt_stack["orchestrator"].address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        messages = [
            m
            async for m in stub.Ask(
                orchestrator_pb2.AskRequest(question="Which river flows through Warsaw?"),
                timeout=120,
                metadata=token,
            )
        ]
    assert messages[-1].WhichOneof("event") == "result"  # answered (or honestly not)
