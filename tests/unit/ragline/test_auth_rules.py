"""Authentication rules: client tokens at the edge, the service credential between services."""

from __future__ import annotations

import time

import jwt
import pytest

from ragline.auth import (
    AUTHORIZATION_KEY,
    AuthConfig,
    Authenticator,
    ServiceCredential,
    mint_token,
)
from ragline.config import ConfigError
from ragline.errors import PermissionDenied, StartRefused, Unauthenticated
from ragline.identity import Caller

KEY = "client-signing-key-for-tests-only-0123456789"
SERVICE_KEY = "service-signing-key-for-tests-only-0123456789"
ON = AuthConfig(mode="jwt", jwt_key=KEY, service_key=SERVICE_KEY)


def bearer(token: str) -> tuple[str, str]:
    return (AUTHORIZATION_KEY, f"Bearer {token}")


def test_off_believes_identity_metadata_as_before():
    found = Authenticator(AuthConfig(mode="off")).authenticate([("x-ragline-tenant", "acme")])
    assert found.caller == Caller("acme") and found.via == "metadata"


def test_a_valid_token_gives_the_caller_from_its_claims():
    token = mint_token(KEY, "acme", principal="ana", scopes=["eng", "hr"])
    found = Authenticator(ON).authenticate([bearer(token)])
    assert found.caller == Caller("acme", "ana", frozenset({"eng", "hr"}))
    assert found.via == "token"


def test_a_forged_tenant_header_is_refused():
    with pytest.raises(Unauthenticated, match="alone is not believed"):
        Authenticator(ON).authenticate([("x-ragline-tenant", "acme")])
    with pytest.raises(Unauthenticated, match="Bearer"):
        Authenticator(ON).authenticate([])


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (mint_token("another-key-entirely-0123456789abcdef", "acme"), "Signature"),
        (mint_token(KEY, "acme", ttl_s=-120), "expired"),
        (mint_token(KEY, "acme", audience="someone-else"), "(?i)audience"),
        (jwt.encode({"tenant": "acme", "aud": "ragline"}, KEY), "exp"),
        (jwt.encode({"exp": time.time() + 60, "aud": "ragline"}, KEY), "tenant"),
        (mint_token(KEY, "bad tenant!"), "tenant claim"),
        ("not-a-jwt", "refused"),
    ],
)
def test_bad_tokens_are_unauthenticated(token, why):
    with pytest.raises(Unauthenticated, match=why):
        Authenticator(ON).authenticate([bearer(token)])


def test_metadata_cannot_change_the_tenant_or_add_scopes():
    token = mint_token(KEY, "acme", scopes=["eng"])
    authenticator = Authenticator(ON)
    with pytest.raises(PermissionDenied, match="token is for 'acme'"):
        authenticator.authenticate([bearer(token), ("x-ragline-tenant", "globex")])
    with pytest.raises(PermissionDenied, match="does not hold scope"):
        authenticator.authenticate([bearer(token), ("x-ragline-scopes", "eng,hr")])
    narrowed = authenticator.authenticate([bearer(token), ("x-ragline-scopes", "eng")])
    assert narrowed.caller.scopes == {"eng"}


def test_a_scope_the_next_hop_would_read_as_two_is_a_malformed_claim():
    # Identity metadata joins scopes with commas: "hr,exec" would become two scopes on the
    # next hop, one of which the token never held.
    token = mint_token(KEY, "acme", scopes=["hr,exec"])
    with pytest.raises(Unauthenticated, match="scopes"):
        Authenticator(ON).authenticate([bearer(token)])


def test_the_write_scope_is_a_permission_not_a_visibility_scope():
    token = mint_token(KEY, "acme", scopes=["eng", "ragline:write"])
    caller = Authenticator(ON).authenticate([bearer(token)]).caller
    assert caller.may_write and caller.visibility == {"eng"}
    reader = Authenticator(ON).authenticate([bearer(token), ("x-ragline-scopes", "eng")])
    assert not reader.caller.may_write  # narrowed away for this call


def test_services_pass_the_verified_caller_with_their_credential():
    credential = ServiceCredential(ON, "orchestrator").metadata()
    found = Authenticator(ON).authenticate(
        [*credential, ("x-ragline-tenant", "acme"), ("x-ragline-scopes", "hr")]
    )
    assert found.caller == Caller("acme", "", frozenset({"hr"})) and found.via == "service"
    forged = ServiceCredential(
        AuthConfig(mode="jwt", jwt_key=KEY, service_key="x" * 40), "intruder"
    ).metadata()
    with pytest.raises(Unauthenticated, match="service credential"):
        Authenticator(ON).authenticate([*forged, ("x-ragline-tenant", "acme")])
    # A client token is not a service credential (another key, another audience).
    with pytest.raises(Unauthenticated, match="service credential"):
        Authenticator(ON).authenticate(
            [("x-ragline-service-credential", mint_token(KEY, "acme")), ("x-ragline-tenant", "a")]
        )


def test_public_key_tokens(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "issuer.pem").write_bytes(public_pem)
    config = AuthConfig(
        mode="jwt", jwt_public_key_file=tmp_path / "issuer.pem", service_key=SERVICE_KEY
    )
    token = mint_token(private, "acme", principal="ana", algorithm="ES256")
    assert Authenticator(config).authenticate([bearer(token)]).caller.tenant == "acme"
    with pytest.raises(Unauthenticated):  # an HMAC token signed with the public key's text
        Authenticator(config).authenticate([bearer(mint_token(KEY, "acme"))])


def test_jwt_mode_needs_its_keys():
    with pytest.raises(ConfigError, match="RAGLINE_AUTH_JWT_KEY"):
        Authenticator(AuthConfig(mode="jwt", service_key=SERVICE_KEY))
    with pytest.raises(ConfigError, match="RAGLINE_AUTH_SERVICE_KEY"):
        Authenticator(AuthConfig(mode="jwt", jwt_key=KEY, service_key="short"))


def test_the_service_credential_is_renewed_before_it_expires(monkeypatch):
    credential = ServiceCredential(
        AuthConfig(mode="jwt", jwt_key=KEY, service_key=SERVICE_KEY, service_credential_ttl_s=60)
    )
    first = credential.metadata()
    assert credential.metadata() == first  # cached
    later = time.time() + 31
    monkeypatch.setattr(time, "time", lambda: later)
    assert credential.metadata() != first
    assert ServiceCredential(AuthConfig(mode="off")).metadata() == ()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_with_auth_off_loopback_addresses_may_serve(host):
    AuthConfig(mode="off").check_exposure(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "ragline.example.com"])
def test_with_auth_off_an_address_others_reach_is_refused_unless_the_network_is_trusted(host):
    with pytest.raises(StartRefused, match="RAGLINE_AUTH_MODE=jwt"):
        AuthConfig(mode="off").check_exposure(host)
    AuthConfig(mode="off", trusted_network=True).check_exposure(host)
    AuthConfig(mode="jwt", jwt_key="k" * 32, service_key="s" * 32).check_exposure(host)


def test_a_token_that_lives_longer_than_the_service_accepts_is_refused():
    day = mint_token(KEY, "acme", ttl_s=86400)
    assert Authenticator(ON).authenticate([bearer(day)]).caller.tenant == "acme"
    year = mint_token(KEY, "acme", ttl_s=365 * 86400)
    with pytest.raises(Unauthenticated, match="lives too long") as refused:
        Authenticator(ON).authenticate([bearer(year)])
    assert refused.value.reason == "TOKEN_LIFETIME"
    # 0: no limit (a deployment that manages lifetimes elsewhere)
    unlimited = AuthConfig(mode="jwt", jwt_key=KEY, service_key=SERVICE_KEY, max_token_lifetime_s=0)
    assert Authenticator(unlimited).authenticate([bearer(year)]).caller.tenant == "acme"
