"""Who is calling: signed tokens at the edge, a service credential between services.

With `RAGLINE_AUTH_MODE=off` (the embedded laptop default) the caller is whatever the
`x-ragline-tenant` / `-principal` / `-scopes` metadata says, as before: anyone who reaches a
port can claim any tenant. With `jwt`:

- A client sends `authorization: Bearer <JWT>`. The token is verified (signature, `exp`,
  `nbf`, audience, issuer when set) with the HMAC key `RAGLINE_AUTH_JWT_KEY`, the public
  key in `RAGLINE_AUTH_JWT_PUBLIC_KEY_FILE`, or the key its `kid` names in the identity
  provider's key set `RAGLINE_AUTH_JWKS_URL` (`ragline.jwks`); its claims give the
  caller: `tenant`, `sub` (principal), `scopes` (a list, or one space-separated string)
  and `ragline_operator` (true: also sees figures that count every tenant). Identity
  metadata may narrow the scopes (`x-ragline-scopes`: only ones the token holds, else
  PERMISSION_DENIED) and may repeat the token's tenant, never change it.
- A service calling another service passes the verified caller on in the identity metadata
  and proves it is a ragline service with `x-ragline-service-credential`: a short-lived JWT
  naming the service, signed with its own private key (`RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE`,
  its `kid` the service's name) and verified with that service's public key from
  `RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR`, so a compromised pod cannot act as another
  service; or, where no keys are set (a laptop, tests), signed with the shared HMAC key
  `RAGLINE_AUTH_SERVICE_KEY`. Clients hold neither. Only then is identity metadata
  believed.
- Any other call to a ragline method is UNAUTHENTICATED (health and reflection stay open:
  probes and `grpcurl list` need no token).

Why one file of this length: the edge's tokens and the services' credentials are checked
by one interceptor and must refuse alike (fetching key sets is jwks.py's).
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ragline.config import ConfigError, EmptyMeansUnset
from ragline.errors import PermissionDenied, StartRefused, Unauthenticated
from ragline.identity import (
    NAME_RULE,
    SCOPES_KEY,
    TENANT_KEY,
    TENANT_RULE,
    Caller,
    caller_from_metadata,
    is_name,
    is_tenant,
)

AUTHORIZATION_KEY = "authorization"
SERVICE_CREDENTIAL_KEY = "x-ragline-service-credential"
SERVICE_ISSUER = "ragline-service"


class AuthConfig(EmptyMeansUnset):
    """Authentication settings shared by every process (prefix `RAGLINE_AUTH_`)."""

    model_config = SettingsConfigDict(env_prefix="RAGLINE_AUTH_", extra="ignore")

    mode: Literal["off", "jwt"] = "off"
    # Verifies client tokens: an HMAC key (HS256/384/512) ...
    jwt_key: str = ""
    # ... or a PEM public key (RS*/ES*/EdDSA) ...
    jwt_public_key_file: Path | None = None
    # ... or the identity provider's key set (https://... or file://...), keys by `kid`.
    jwks_url: str = ""
    # How often the key set is fetched again (also soon after a token names an unknown key).
    jwks_refresh_s: float = Field(300.0, ge=10)
    jwt_algorithms: str = "HS256,RS256,ES256"
    jwt_audience: str = "ragline"
    jwt_issuer: str = ""  # checked when set
    leeway_s: float = Field(30.0, ge=0)
    # The longest a client token may still live when it is shown (its exp from now): a
    # leaked token that never expires is a key. 0: no limit.
    max_token_lifetime_s: float = Field(86400.0, ge=0)
    # Signs and verifies the credential services present to each other: one HMAC key
    # shared by every service ...
    service_key: str = ""
    # ... or each service's own private key (PEM: EC P-256 or Ed25519), and a folder of
    # every service's public key as `<service>.pem` (a public key or a certificate); with
    # the folder set, a credential signed with the shared key is refused.
    service_private_key_file: Path | None = None
    service_public_keys_dir: Path | None = None
    service_credential_ttl_s: float = Field(300.0, gt=10)
    # With authentication off a service listens on loopback only, unless this says the
    # network itself keeps strangers out (a sealed test network, a mesh with mTLS).
    trusted_network: bool = False

    def check_exposure(self, host: str) -> None:
        """Refuses to serve with authentication off on an address others can reach: any
        caller there could claim any tenant."""
        if self.mode != "off" or self.trusted_network or _loopback(host):
            return
        raise StartRefused(
            f"authentication is off and {host!r} is not a loopback address: anyone who "
            "reaches it can claim any tenant. Turn authentication on (RAGLINE_AUTH_MODE=jwt, "
            "docs/security.md), listen on 127.0.0.1, or set RAGLINE_AUTH_TRUSTED_NETWORK=true "
            "where the network itself admits no one else"
        )

    def check(self) -> None:
        if self.mode == "off":
            return
        verifiers = [self.jwt_key, self.jwt_public_key_file, self.jwks_url]
        if not any(verifiers):
            raise ConfigError(
                "RAGLINE_AUTH_MODE=jwt needs RAGLINE_AUTH_JWT_KEY (HMAC), "
                "RAGLINE_AUTH_JWT_PUBLIC_KEY_FILE (PEM) or RAGLINE_AUTH_JWKS_URL (a key set) to "
                "verify client tokens"
            )
        if sum(1 for v in verifiers if v) > 1:
            raise ConfigError(
                "set one of RAGLINE_AUTH_JWT_KEY, RAGLINE_AUTH_JWT_PUBLIC_KEY_FILE and "
                "RAGLINE_AUTH_JWKS_URL: one kind of key verifies client tokens"
            )
        if self.jwks_url and not self.jwks_url.startswith(("https://", "http://", "file://")):
            raise ConfigError(
                f"RAGLINE_AUTH_JWKS_URL={self.jwks_url!r}: expected https://, http:// or file://"
            )
        if self.service_private_key_file is not None and self.service_public_keys_dir is None:
            raise ConfigError(
                "RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE is set without "
                "RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR: a service that signs with its own key "
                "verifies the others' with theirs"
            )
        if self.service_public_keys_dir is None and len(self.service_key) < 32:
            raise ConfigError(
                "RAGLINE_AUTH_MODE=jwt needs the service-to-service credential's keys: "
                "RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE and RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR "
                "(each service its own key), or RAGLINE_AUTH_SERVICE_KEY (at least 32 "
                "characters, shared by the services only)"
            )


ORCHESTRATOR = "orchestrator"


@dataclass(frozen=True)
class Authenticated:
    caller: Caller | None
    via: str  # "token", "service", "metadata" (auth off) or "none"
    # The calling ragline service its credential names (verified by the service's own key
    # where keys are per service); "" for anyone else.
    service: str = ""


# How the call in progress authenticated (`Authenticated.via`, `.service`), bound by the
# server's interceptor for the call's handler.
_via: ContextVar[tuple[str, str]] = ContextVar("ragline_auth_via", default=("none", ""))


def bind_via(via: str, service: str = "") -> Token[tuple[str, str]]:
    return _via.set((via, service))


def unbind_via(token: Token[tuple[str, str]]) -> None:
    _via.reset(token)


def from_the_orchestrator() -> bool:
    """Whether the call in progress came from the orchestrator's credential, or from anyone
    while authentication is off: only then are scheduling hints in a request believed
    (`GenerateRequest.light_tenant`: one tenant could otherwise pause all others), never
    from an end user's token or another service."""
    via, service = _via.get()
    return via in ("metadata", "none") or (via == "service" and service == ORCHESTRATOR)


def _service_algorithm(key: Any) -> str:
    """The JWT algorithm of a service's key pair (EC P-256: ES256; Ed25519: EdDSA)."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        if key.curve.name != "secp256r1":
            raise ConfigError(f"a service key on curve {key.curve.name}: use P-256 or Ed25519")
        return "ES256"
    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return "EdDSA"
    raise ConfigError(f"a service key of type {type(key).__name__}: use EC P-256 or Ed25519")


def load_service_public_keys(folder: Path) -> dict[str, tuple[Any, str]]:
    """Each `<service>.pem` of `folder` (a public key, or a certificate holding one) and the
    algorithm its credentials are signed with, by service name."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    keys: dict[str, tuple[Any, str]] = {}
    for path in sorted(folder.glob("*.pem")):
        data = path.read_bytes()
        key: Any
        if b"BEGIN CERTIFICATE" in data:
            key = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = load_pem_public_key(data)
        # a key of a kind no credential is signed with is refused now, not at a call
        keys[path.stem] = (key, _service_algorithm(key))
    if not keys:
        raise ConfigError(
            f"RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR={folder} holds no <service>.pem: no "
            "service's credential could be verified"
        )
    return keys


def _values(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    return {
        key.lower(): value.decode() if isinstance(value, bytes) else value
        for key, value in (metadata or ())
    }


def _scopes_claim(value: Any) -> frozenset[str]:  # a token's claim: any JSON
    if value is None:
        return frozenset()
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise Unauthenticated("the token's `scopes` claim must be a list or a string")
    # A scope the identity metadata could not carry as one ("a,b" would reach the next
    # service as two scopes) is a malformed claim, not a way to hold more.
    bad = [s for s in items if not is_name(s)]
    if bad:
        raise Unauthenticated(
            f"the token's `scopes` claim holds {bad[0]!r}: each scope must be {NAME_RULE}"
        )
    return frozenset(items)


class Authenticator:
    def __init__(self, config: AuthConfig | None = None) -> None:
        import jwt

        self._jwt = jwt
        self.config = config or AuthConfig()
        self.config.check()
        self.enabled = self.config.mode == "jwt"
        key = self.config.jwt_key
        if self.config.jwt_public_key_file is not None:
            key = self.config.jwt_public_key_file.read_text()
        self._client_key = key
        # One key, one family: an HMAC key never verifies RS/ES tokens and a public key never
        # verifies HS tokens (the algorithm-confusion attack).
        hmac = bool(self.config.jwt_key)
        named = (a.strip() for a in self.config.jwt_algorithms.split(","))
        self._algorithms = [a for a in named if a and a.startswith("HS") == hmac]
        if self.enabled and not self._algorithms:
            raise ConfigError(
                f"RAGLINE_AUTH_JWT_ALGORITHMS ({self.config.jwt_algorithms}) has no algorithm "
                f"for {'an HMAC key' if hmac else 'a public key'}"
            )
        self._service_keys: dict[str, tuple[Any, str]] | None = None
        if self.enabled and self.config.service_public_keys_dir is not None:
            self._service_keys = load_service_public_keys(self.config.service_public_keys_dir)
        self._jwks = None
        if self.enabled and self.config.jwks_url:
            from ragline.jwks import JwksKeys

            self._jwks = JwksKeys(
                self.config.jwks_url,
                refresh_s=self.config.jwks_refresh_s,
                algorithms=self._algorithms,
            )

    def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """Blocks until client tokens can be verified (a key set fetched once); True at
        once without a key set."""
        if self._jwks is None:
            return True
        return self._jwks.wait_first_fetch(timeout_s) and bool(self._jwks.known_ids())

    def close(self) -> None:
        if self._jwks is not None:
            self._jwks.close()

    def _verifying_key(self, token: str) -> tuple[Any, list[str]]:
        """The key and algorithms that verify `token`: the configured key, or the key set's
        key the token names (`kid`). Any: an HMAC secret (bytes) or a public key object of
        the `cryptography` package, as PyJWT takes either."""
        if self._jwks is None:
            return self._client_key, self._algorithms
        try:
            kid = self._jwt.get_unverified_header(token).get("kid")
        except self._jwt.PyJWTError as error:
            raise Unauthenticated(f"the token was refused: {error}") from None
        if not isinstance(kid, str) or not kid:
            raise Unauthenticated(
                "the token names no signing key (`kid` header): tokens are verified with the "
                "identity provider's key set"
            )
        key = self._jwks.key(kid)
        if key is None:
            raise Unauthenticated(
                f"the token's signing key {kid!r} is not in the identity provider's key set "
                "as last fetched; if its keys were just rotated, retry in a few seconds",
                reason="UNKNOWN_SIGNING_KEY",
            )
        return key.key, [key.algorithm_name]

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Authenticated:
        if not self.enabled:
            caller = caller_from_metadata(metadata)
            return Authenticated(caller, "metadata" if caller else "none")
        values = _values(metadata)
        bearer = values.get(AUTHORIZATION_KEY, "")
        if bearer:
            return Authenticated(self._from_token(bearer, values), "token")
        credential = values.get(SERVICE_CREDENTIAL_KEY, "")
        if credential:
            service = self._verify_service(credential)
            return Authenticated(caller_from_metadata(metadata), "service", service)
        if values.get(TENANT_KEY, "").strip():
            raise Unauthenticated(
                f"authentication is on: metadata {TENANT_KEY} alone is not believed; send "
                "`authorization: Bearer <token>` (a JWT with tenant, sub and scopes claims)"
            )
        raise Unauthenticated(
            "authentication is on: send `authorization: Bearer <token>` (a JWT with tenant, "
            "sub and scopes claims)"
        )

    def _from_token(self, bearer: str, values: dict[str, str]) -> Caller:
        scheme, _, token = bearer.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("metadata authorization must be `Bearer <token>`")
        key, algorithms = self._verifying_key(token.strip())
        try:
            claims = self._jwt.decode(
                token.strip(),
                key,
                algorithms=algorithms,
                audience=self.config.jwt_audience or None,
                issuer=self.config.jwt_issuer or None,
                leeway=self.config.leeway_s,
                options={"require": ["exp", "tenant"]},
            )
        except self._jwt.ExpiredSignatureError:
            raise Unauthenticated(
                "the token has expired; get a new one", reason="TOKEN_EXPIRED"
            ) from None
        except self._jwt.PyJWTError as error:
            raise Unauthenticated(f"the token was refused: {error}") from None
        most = self.config.max_token_lifetime_s
        remaining = float(claims["exp"]) - time.time()
        if most and remaining > most + self.config.leeway_s:
            raise Unauthenticated(
                f"the token lives too long: it expires in {remaining:.0f} s, and this service "
                f"accepts tokens that expire within {most:.0f} s "
                "(RAGLINE_AUTH_MAX_TOKEN_LIFETIME_S); get a shorter-lived one",
                reason="TOKEN_LIFETIME",
            )
        tenant = claims.get("tenant")
        if not isinstance(tenant, str) or not is_tenant(tenant):
            raise Unauthenticated(f"the token's tenant claim must be {TENANT_RULE}")
        principal = claims.get("sub", "")
        if not isinstance(principal, str) or (principal and not is_name(principal)):
            raise Unauthenticated("the token's sub claim is not a valid principal name")
        held = _scopes_claim(claims.get("scopes"))
        claimed_tenant = values.get(TENANT_KEY, "").strip()
        if claimed_tenant and claimed_tenant != tenant:
            raise PermissionDenied(
                f"metadata {TENANT_KEY} is {claimed_tenant!r} but the token is for {tenant!r}",
                reason="TENANT_MISMATCH",
            )
        asked = frozenset(s.strip() for s in values.get(SCOPES_KEY, "").split(",") if s.strip())
        if asked - held:
            raise PermissionDenied(
                f"the token does not hold scope(s) {', '.join(sorted(asked - held))} asked for "
                f"in metadata {SCOPES_KEY}",
                reason="SCOPE_NOT_HELD",
                metadata={"scopes": ",".join(sorted(asked - held))},
            )
        operator = claims.get("ragline_operator") is True
        return Caller(tenant=tenant, principal=principal, scopes=asked or held, operator=operator)

    def _verify_service(self, credential: str) -> str:
        """The calling service's name: the `kid` whose public key verifies the credential
        (per-service keys), or the `sub` of one signed with the shared key."""
        key: Any = self.config.service_key
        algorithms = ["HS256"]
        kid = ""
        if self._service_keys is not None:
            try:
                kid = self._jwt.get_unverified_header(credential).get("kid") or ""
            except self._jwt.PyJWTError as error:
                raise Unauthenticated(f"the service credential was refused: {error}") from None
            if not isinstance(kid, str) or kid not in self._service_keys:
                raise Unauthenticated(
                    f"the service credential names no service whose key this service holds "
                    f"(kid {kid!r}); each service signs with its own key"
                )
            key, algorithm = self._service_keys[kid]
            algorithms = [algorithm]
        try:
            claims = self._jwt.decode(
                credential,
                key,
                algorithms=algorithms,
                issuer=SERVICE_ISSUER,
                audience=SERVICE_ISSUER,
                leeway=self.config.leeway_s,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except self._jwt.PyJWTError as error:
            raise Unauthenticated(f"the service credential was refused: {error}") from None
        service = claims["sub"] if isinstance(claims["sub"], str) else ""
        if kid and service != kid:
            raise Unauthenticated(
                f"the service credential of {kid!r} speaks for {service!r}: refused"
            )
        return service


class ServiceCredential:
    """The credential this process presents to other ragline services (minted, cached and
    renewed before it expires). Empty when authentication is off."""

    def __init__(self, config: AuthConfig | None = None, name: str = "ragline") -> None:
        import jwt

        self._jwt = jwt
        self.config = config or AuthConfig()
        self.name = name
        self._token, self._renew_at = "", 0.0
        self._private_key: Any = None
        self._algorithm = "HS256"
        path = self.config.service_private_key_file
        if self.config.mode == "jwt" and path is not None:
            from cryptography.hazmat.primitives.serialization import load_pem_private_key

            try:
                self._private_key = load_pem_private_key(path.read_bytes(), password=None)
            except (OSError, ValueError) as error:
                raise ConfigError(
                    f"RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE={path}: not a readable PEM private "
                    f"key ({error})"
                ) from None
            self._algorithm = _service_algorithm(self._private_key)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self.config.mode != "jwt" or not (self._private_key or self.config.service_key):
            return ()
        now = time.time()
        if now >= self._renew_at:
            ttl = self.config.service_credential_ttl_s
            claims = {
                "iss": SERVICE_ISSUER,
                "aud": SERVICE_ISSUER,
                "sub": self.name,
                "iat": int(now),
                "exp": int(now + ttl),
            }
            if self._private_key is not None:
                self._token = self._jwt.encode(
                    claims,
                    self._private_key,
                    algorithm=self._algorithm,
                    headers={"kid": self.name},
                )
            else:
                self._token = self._jwt.encode(claims, self.config.service_key, algorithm="HS256")
            self._renew_at = now + ttl / 2
        return ((SERVICE_CREDENTIAL_KEY, self._token),)


def mint_token(
    key: str,
    tenant: str,
    *,
    principal: str = "",
    scopes: Iterable[str] = (),
    ttl_s: float = 3600.0,
    audience: str = "ragline",
    algorithm: str = "HS256",
    operator: bool = False,
) -> str:
    """A client token signed with `key` (for development, tests and `ragline token`)."""
    import jwt

    now = int(time.time())
    claims = {
        "tenant": tenant,
        "scopes": sorted(scopes),
        "aud": audience,
        "iat": now,
        "exp": int(now + ttl_s),
    }
    if principal:
        claims["sub"] = principal
    if operator:
        claims["ragline_operator"] = True
    return jwt.encode(claims, key, algorithm=algorithm)


_process_credential: ServiceCredential | None = None
_process_service = "ragline"


def name_process_service(name: str) -> None:
    """The service this process serves (`ragline serve NAME`): the name its credential
    speaks for, and with per-service keys the key it signs with belongs to."""
    global _process_service, _process_credential
    _process_service, _process_credential = name, None


def process_credential() -> ServiceCredential:
    """This process's service credential, from the environment (read once)."""
    global _process_credential
    if _process_credential is None:
        _process_credential = ServiceCredential(AuthConfig(), _process_service)
    return _process_credential


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False
