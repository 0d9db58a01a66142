"""The key set holder: a mounted file as well as a URL, only signing keys, a fetch soon
after a token names a key it lacks, the last good set kept when a fetch fails."""

from __future__ import annotations

import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from ragline import jwks
from ragline.jwks import JwksKeys


def jwk(kid: str, **extra) -> dict:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    return {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key)), "kid": kid, **extra}


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def key_file(tmp_path):
    return tmp_path / "jwks.json"


def test_a_mounted_file_holds_only_signing_keys_of_allowed_algorithms(key_file):
    key_file.write_text(
        json.dumps(
            {
                "keys": [
                    jwk("a", alg="ES256"),
                    jwk("encryption", use="enc"),
                    {"kty": "oct", "kid": "shared", "k": "c2VjcmV0"},
                    {**jwk("none"), "kid": ""},
                ]
            }
        )
    )
    keys = JwksKeys(key_file.as_uri(), refresh_s=300, algorithms=["ES256", "RS256"])
    assert keys.wait_first_fetch(5)
    assert keys.known_ids() == ["a"]
    keys.close()


def test_a_token_naming_an_unknown_key_brings_a_fetch_soon(key_file, monkeypatch):
    monkeypatch.setattr(jwks, "MIN_REFETCH_S", 0.2)
    key_file.write_text(json.dumps({"keys": [jwk("a")]}))
    keys = JwksKeys(key_file.as_uri(), refresh_s=300, algorithms=["ES256"])
    assert keys.wait_first_fetch(5)
    key_file.write_text(json.dumps({"keys": [jwk("a"), jwk("b")]}))
    assert keys.key("b") is None  # not yet: the periodic fetch is minutes away
    assert wait_for(lambda: keys.key("b") is not None)
    keys.close()


def test_a_failed_fetch_keeps_the_last_good_set(key_file, monkeypatch):
    monkeypatch.setattr(jwks, "MIN_REFETCH_S", 0.2)
    key_file.write_text(json.dumps({"keys": [jwk("a")]}))
    keys = JwksKeys(key_file.as_uri(), refresh_s=300, algorithms=["ES256"])
    assert keys.wait_first_fetch(5)
    key_file.write_text("{not json")
    keys.key("unknown")  # asks for a fetch, which fails
    assert wait_for(lambda: keys.last_error != "")
    assert keys.known_ids() == ["a"]
    keys.close()


def test_one_kind_of_key_verifies_client_tokens():
    from ragline.auth import AuthConfig
    from ragline.config import ConfigError

    both = AuthConfig(mode="jwt", jwt_key="k", jwks_url="https://idp/jwks", service_key="s" * 40)
    with pytest.raises(ConfigError, match="one kind of key"):
        both.check()
    odd = AuthConfig(mode="jwt", jwks_url="ldap://idp/jwks", service_key="s" * 40)
    with pytest.raises(ConfigError, match="RAGLINE_AUTH_JWKS_URL"):
        odd.check()
    AuthConfig(mode="jwt", jwks_url="file:///keys/jwks.json", service_key="s" * 40).check()
