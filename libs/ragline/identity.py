"""The authenticated caller, read from gRPC metadata (never from a request body)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass

from ragline.errors import InvalidArgument, PermissionDenied, Unauthenticated

TENANT_KEY = "x-ragline-tenant"
PRINCIPAL_KEY = "x-ragline-principal"
SCOPES_KEY = "x-ragline-scopes"
# An operator also sees figures that count every tenant (index totals, batch sizes).
OPERATOR_KEY = "x-ragline-operator"
RUN_ID_KEY = "x-ragline-run-id"

# Scopes under this prefix are permissions, not visibility: no document's acl may name
# one, and they take no part in what a caller sees.
RESERVED_SCOPE_PREFIX = "ragline:"
# Held, the caller may write (Upsert, Delete) documents within its visibility scopes.
WRITE_SCOPE = "ragline:write"

_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TENANT_RULE = "1-64 characters of letters, digits, '_', '.', '-'"
NAME_RULE = "1-128 characters of letters, digits, '_.:@-'"


def is_tenant(value: str) -> bool:
    """Whether `value` is a well-formed tenant id."""
    return bool(_TENANT.match(value))


def is_name(value: str) -> bool:
    """Whether `value` is a well-formed principal or scope name."""
    return bool(_NAME.match(value))


@dataclass(frozen=True)
class Caller:
    tenant: str
    principal: str = ""
    scopes: frozenset[str] = frozenset()
    operator: bool = False

    @property
    def may_write(self) -> bool:
        return WRITE_SCOPE in self.scopes

    @property
    def visibility(self) -> frozenset[str]:
        """The scopes that decide which documents the caller sees (no permissions)."""
        return frozenset(s for s in self.scopes if not s.startswith(RESERVED_SCOPE_PREFIX))

    def metadata(self) -> list[tuple[str, str]]:
        pairs = [(TENANT_KEY, self.tenant)]
        if self.principal:
            pairs.append((PRINCIPAL_KEY, self.principal))
        if self.scopes:
            pairs.append((SCOPES_KEY, ",".join(sorted(self.scopes))))
        if self.operator:
            pairs.append((OPERATOR_KEY, "true"))
        return pairs


def write_scope_missing(what: str) -> PermissionDenied:
    """The refusal of a call that changes stored data to a caller without WRITE_SCOPE."""
    return PermissionDenied(
        f"{what} needs the scope {WRITE_SCOPE}, which this caller does not hold (a "
        "token's scopes claim; with authentication off, metadata x-ragline-scopes)",
        reason="WRITE_SCOPE_NOT_HELD",
        metadata={"scope": WRITE_SCOPE},
    )


_caller: ContextVar[Caller | None] = ContextVar("ragline_caller", default=None)
_run_id: ContextVar[str | None] = ContextVar("ragline_run_id", default=None)


def _as_text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def caller_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller | None:
    """Parses the caller; None when no tenant is given. Malformed values are INVALID_ARGUMENT."""
    values = {key.lower(): _as_text(value) for key, value in (metadata or ())}
    tenant = values.get(TENANT_KEY, "").strip()
    if not tenant:
        return None
    if not is_tenant(tenant):
        raise InvalidArgument(f"metadata {TENANT_KEY}", f"must be {TENANT_RULE}")
    principal = values.get(PRINCIPAL_KEY, "").strip()
    if principal and not is_name(principal):
        raise InvalidArgument(f"metadata {PRINCIPAL_KEY}", f"must be {NAME_RULE}")
    scopes = frozenset(s.strip() for s in values.get(SCOPES_KEY, "").split(",") if s.strip())
    for scope in scopes:
        if not is_name(scope):
            raise InvalidArgument(f"metadata {SCOPES_KEY}", f"scope {scope!r} must be {NAME_RULE}")
    operator = values.get(OPERATOR_KEY, "").strip().lower() in ("true", "1")
    return Caller(tenant=tenant, principal=principal, scopes=scopes, operator=operator)


def run_id_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key.lower() == RUN_ID_KEY:
            text = _as_text(value).strip()
            if is_name(text):
                return text
    return uuid.uuid4().hex[:16]


def current_caller() -> Caller:
    """The caller of the call in progress; UNAUTHENTICATED when none was given."""
    caller = _caller.get()
    if caller is None:
        raise Unauthenticated(
            f"this call needs the caller's tenant in metadata {TENANT_KEY} "
            f"(and optionally {PRINCIPAL_KEY}, {SCOPES_KEY})"
        )
    return caller


def optional_caller() -> Caller | None:
    return _caller.get()


def current_run_id() -> str | None:
    return _run_id.get()


# What `bind` returns and `unbind` takes: the reset tokens of the two context variables.
Bound = tuple["Token[Caller | None]", "Token[str | None]"]


def bind(caller: Caller | None, run_id: str | None) -> Bound:
    """Sets caller and run id for the enclosed work; returns tokens for `unbind`."""
    return _caller.set(caller), _run_id.set(run_id)


def unbind(tokens: Bound) -> None:
    caller_token, run_token = tokens
    _run_id.reset(run_token)
    _caller.reset(caller_token)


def outbound_metadata() -> list[tuple[str, str]]:
    """Metadata that carries the caller and run id to the next hop."""
    pairs: list[tuple[str, str]] = []
    caller = _caller.get()
    if caller is not None:
        pairs.extend(caller.metadata())
    run_id = _run_id.get()
    if run_id:
        pairs.append((RUN_ID_KEY, run_id))
    return pairs
