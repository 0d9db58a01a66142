"""Each service its own key (issue 57): a credential speaks for the service whose private
key signed it, so a compromised pod cannot act as another service, and the shared key is
refused where per-service keys are set."""

from __future__ import annotations

import jwt
import pytest

from ragline.auth import (
    SERVICE_CREDENTIAL_KEY,
    SERVICE_ISSUER,
    AuthConfig,
    Authenticator,
    ServiceCredential,
)
from ragline.config import ConfigError
from ragline.errors import Unauthenticated
from support import service_key_pairs

CLIENT_KEY = "client-signing-key-for-tests-only-0123456789"
SHARED_KEY = "service-signing-key-for-tests-only-0123456789"
NAMES = ("orchestrator", "retrieval", "generation")


def config(env: dict[str, str], **extra) -> AuthConfig:
    return AuthConfig(
        mode="jwt",
        jwt_key=CLIENT_KEY,
        service_private_key_file=env["RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE"],
        service_public_keys_dir=env["RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR"],
        **extra,
    )


@pytest.fixture(params=["ec", "ed25519"])
def keys(request, tmp_path):
    return service_key_pairs(tmp_path, NAMES, kind=request.param)


def credential(keys, name: str, speaks_for: str | None = None) -> list[tuple[str, str]]:
    """`name`'s credential as its process mints it (`speaks_for`: the service it claims)."""
    minted = ServiceCredential(config(keys[name]), speaks_for or name)
    return [*minted.metadata(), ("x-ragline-tenant", "acme")]


def test_a_credential_speaks_for_the_service_whose_key_signed_it(keys):
    verifier = Authenticator(config(keys["generation"]))
    found = verifier.authenticate(credential(keys, "retrieval"))
    assert found.via == "service" and found.service == "retrieval"
    assert found.caller is not None and found.caller.tenant == "acme"
    assert verifier.authenticate(credential(keys, "orchestrator")).service == "orchestrator"


def test_a_service_cannot_speak_for_another(keys):
    """Retrieval's key, claiming to be the orchestrator: by its kid (then the
    orchestrator's public key does not verify it) or by its sub alone."""
    verifier = Authenticator(config(keys["generation"]))
    with pytest.raises(Unauthenticated):  # kid orchestrator, signed with retrieval's key
        retrieval = config(keys["retrieval"])
        forged = ServiceCredential(retrieval, "orchestrator")
        verifier.authenticate(forged.metadata())
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    own = load_pem_private_key(
        open(keys["retrieval"]["RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE"], "rb").read(), None
    )
    from cryptography.hazmat.primitives.asymmetric import ec

    algorithm = "ES256" if isinstance(own, ec.EllipticCurvePrivateKey) else "EdDSA"
    claims = {"iss": SERVICE_ISSUER, "aud": SERVICE_ISSUER, "sub": "orchestrator", "exp": 2**40}
    speaks_for_another = jwt.encode(claims, own, algorithm=algorithm, headers={"kid": "retrieval"})
    with pytest.raises(Unauthenticated, match="speaks for 'orchestrator'"):
        verifier.authenticate([(SERVICE_CREDENTIAL_KEY, speaks_for_another)])


def test_an_unknown_service_and_the_shared_key_are_refused(keys, tmp_path):
    verifier = Authenticator(config(keys["generation"], service_key=SHARED_KEY))
    stranger = service_key_pairs(tmp_path / "elsewhere", ["orchestrator"])["orchestrator"]
    with pytest.raises(Unauthenticated):  # a key of the same name, not the one in the folder
        verifier.authenticate(ServiceCredential(config(stranger), "orchestrator").metadata())
    with pytest.raises(Unauthenticated, match="no service whose key"):
        verifier.authenticate(credential(keys, "retrieval", speaks_for="budget"))
    shared = ServiceCredential(AuthConfig(mode="jwt", jwt_key=CLIENT_KEY, service_key=SHARED_KEY))
    with pytest.raises(Unauthenticated):  # HMAC: no kid the folder knows
        verifier.authenticate(shared.metadata())


def test_the_shared_key_still_works_where_no_keys_are_set_and_names_the_service():
    on = AuthConfig(mode="jwt", jwt_key=CLIENT_KEY, service_key=SHARED_KEY)
    found = Authenticator(on).authenticate(ServiceCredential(on, "orchestrator").metadata())
    assert found.via == "service" and found.service == "orchestrator"


def test_keys_must_come_in_pairs_and_in_a_kind_credentials_are_signed_with(keys, tmp_path):
    env = keys["retrieval"]
    with pytest.raises(ConfigError, match="PUBLIC_KEYS_DIR"):
        AuthConfig(
            mode="jwt",
            jwt_key=CLIENT_KEY,
            service_key=SHARED_KEY,
            service_private_key_file=env["RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE"],
        ).check()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"holds no <service>\.pem"):
        Authenticator(AuthConfig(mode="jwt", jwt_key=CLIENT_KEY, service_public_keys_dir=empty))
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "budget.pem").write_bytes(
        rsa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(ConfigError, match="EC P-256 or Ed25519"):
        Authenticator(AuthConfig(mode="jwt", jwt_key=CLIENT_KEY, service_public_keys_dir=odd))
