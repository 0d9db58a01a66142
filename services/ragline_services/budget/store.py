"""The ledger's storage: etcd, used only through revision-guarded transactions.

Every failure to reach etcd becomes UNAVAILABLE (or DEADLINE_EXCEEDED when the caller's
own deadline ran out): the ledger fails closed and never grants without a committed write.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar

import grpc
import structlog

from ragline import deadlines, tracing
from ragline.breaker import Breaker, BreakerOpen
from ragline.config import ConfigError
from ragline.errors import DeadlineExceeded, Unavailable

if TYPE_CHECKING:
    import etcd3aio
    from etcd3aio.auth import AuthService
    from etcd3aio.kv import KVService
    from etcd3aio.lease import LeaseService


@dataclass(frozen=True)
class Versioned:
    value: bytes
    mod_revision: int


class EtcdTlsArguments(TypedDict, total=False):
    """etcd3aio.Etcd3Client's TLS keywords: the PEM bytes of the CA, certificate and key."""

    ca_cert: bytes
    cert_chain: bytes
    cert_key: bytes


S = TypeVar("S")


def _service(service: S | None) -> S:
    """What is there only once connected: the client, and etcd3aio's service stubs on it."""
    if service is None:
        raise Unavailable("the budget ledger's store is not connected yet (etcd)")
    return service


class LedgerStore(Protocol):
    async def read(self, keys: Sequence[bytes]) -> list[Versioned | None]:
        """The keys' values at one revision (None for a missing key)."""

    async def read_prefix(self, prefix: bytes) -> list[tuple[bytes, Versioned]]: ...

    async def write_if_unchanged(
        self,
        expected: dict[bytes, int],
        puts: dict[bytes, bytes],
        lease_id: int,
        reread: Sequence[bytes] = (),
    ) -> tuple[int | None, list[Versioned | None]]:
        """Writes `puts` iff every key of `expected` still has that mod revision (0 = absent).

        Returns (revision of the write, []) on success, or (None, current values of
        `reread`) when a guard failed and nothing was written: one round trip either way.
        """

    async def grant_lease(self, ttl_s: int) -> int: ...

    async def revoke_lease(self, lease_id: int) -> None: ...

    async def ping(self) -> None: ...


log = structlog.get_logger("ragline.budget.store")
_ETCD_SPAN = {"db.system": "etcd"}
T = TypeVar("T")


@dataclass(frozen=True)
class EtcdAccess:
    """How the ledger reaches etcd beyond its endpoints: TLS (a CA to verify etcd; a client
    certificate where etcd requires one) and an etcd user (etcd auth on)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str = ""
    username: str = ""
    password: str = ""

    def tls_arguments(self) -> EtcdTlsArguments:
        """etcd3aio's channel arguments, read from the files (blocking: call off the loop)."""
        if self.ca_file is None:
            return {}
        arguments: EtcdTlsArguments = {"ca_cert": Path(self.ca_file).read_bytes()}
        if self.cert_file is not None and self.key_file is not None:
            arguments["cert_chain"] = Path(self.cert_file).read_bytes()
            arguments["cert_key"] = Path(self.key_file).read_bytes()
        return arguments


class EtcdLedgerStore:
    """LedgerStore on an etcd v3 cluster through etcd3aio (grpc.aio)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 2.0,
        access: EtcdAccess | None = None,
        ping_key: bytes = b"/ragline/ping",
    ) -> None:
        self.endpoints = list(endpoints)
        self._target = etcd_target(self.endpoints)  # a bad list fails at start, named
        self._timeout_s = timeout_s
        self._access = access or EtcdAccess()
        # A key the ledger's etcd user may read (its role covers the ledger's prefix only).
        self._ping_key = ping_key
        # While etcd does not answer, calls fail at once rather than each waiting
        # `timeout_s` (ragline/breaker.py); the health probe's pings always go.
        self._breaker = Breaker(_is_silence)
        # Told of every etcd operation: its name, "ok" or "error", and its seconds.
        self.observe: Callable[[str, str, float], None] | None = None
        self._client: etcd3aio.Etcd3Client | None = None

    async def connect(self) -> None:
        import etcd3aio

        tls = await asyncio.to_thread(self._access.tls_arguments)
        # One retry for a transient blip; more would only delay the UNAVAILABLE answer.
        client = etcd3aio.Etcd3Client(
            self.endpoints,
            rpc_max_attempts=2,
            tls_server_name=self._access.server_name or None,
            **tls,
        )
        # gRPC's default reconnect backoff grows to 120 s; after an etcd restart the ledger
        # must be back within a second, not minutes. (etcd3aio has no public hook for it.)
        client._manager.grpc_options.extend(
            [
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
        )
        # etcd3aio writes every endpoint into an `ipv4:` target, which takes IP literals
        # only: a name (a headless Service, an external cluster's DNS name) goes to gRPC's
        # DNS resolver instead, which finds every member and resolves again on reconnect.
        client._manager.target = self._target
        await client.connect()
        self._client = client
        if self._access.username:
            with contextlib.suppress(Unavailable):
                # etcd down at start: the first operation authenticates instead
                await self._call("authenticate", self._authenticate)

    @property
    def _connected(self) -> etcd3aio.Etcd3Client:
        return _service(self._client)

    @property
    def _kv(self) -> KVService:
        return _service(self._connected.kv)

    @property
    def _lease(self) -> LeaseService:
        return _service(self._connected.lease)

    @property
    def _auth(self) -> AuthService:
        return _service(self._connected.auth)

    async def _authenticate(self) -> None:
        self._connected.set_token(None)
        reply = await self._auth.authenticate(
            self._access.username, self._access.password, timeout=self._timeout()
        )
        self._connected.set_token(reply.token)

    async def _call(self, operation: str, make: Callable[[], Awaitable[T]]) -> T:
        """One etcd operation under the guard; with etcd auth on, an unknown token (etcd
        restarted, or the token's time ran out) is answered by signing in again, once."""
        import etcd3aio

        async with self._guard(operation):
            try:
                return await make()
            except etcd3aio.EtcdUnauthenticatedError:
                if not self._access.username or make == self._authenticate:
                    raise
                await self._authenticate()
                return await make()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _timeout(self) -> float:
        left = deadlines.remaining()
        return self._timeout_s if left is None else max(min(self._timeout_s, left), 0.001)

    def _unreachable(self, detail: str) -> Unavailable:
        return Unavailable(
            f"budget ledger store unreachable (etcd at {', '.join(self.endpoints)}, "
            f"{detail}); no reservation was granted, retry with the same reservation id",
            reason="LEDGER_STORE_UNAVAILABLE",
        )

    @contextlib.asynccontextmanager
    async def _guard(self, operation: str):
        import etcd3aio

        deadlines.check(f"etcd {operation}")
        started, result = time.perf_counter(), "error"
        try:
            with (
                self._breaker.attempt(probe=operation == "ping"),
                tracing.span(f"etcd {operation}", tracing.SpanKind.CLIENT, _ETCD_SPAN),
            ):
                yield
            result = "ok"
        except BreakerOpen as error:
            result = "breaker_open"
            raise self._unreachable(f"{operation}: {error}") from None
        except (etcd3aio.EtcdUnauthenticatedError, etcd3aio.EtcdPermissionDeniedError) as error:
            # The operator's problem, not the caller's: the detail goes to the log.
            log.error(
                "budget.etcd_refused",
                operation=operation,
                etcd_user=self._access.username or None,
                error=str(error),
                fix="check RAGLINE_BUDGET_ETCD_USERNAME / RAGLINE_BUDGET_ETCD_PASSWORD and "
                "that the user's role reads and writes the ledger's key prefix",
            )
            raise Unavailable(
                "the budget ledger store refused the budget service's credentials; no "
                "reservation was granted (the budget service's log says why)",
                reason="LEDGER_STORE_UNAVAILABLE",
            ) from error
        except (etcd3aio.EtcdError, grpc.aio.AioRpcError, TimeoutError) as error:
            if deadlines.expired():
                raise DeadlineExceeded(
                    f"the deadline passed while the budget ledger waited on etcd ({operation})"
                ) from error
            raise self._unreachable(f"{operation}: {error}") from error
        finally:
            if self.observe is not None and result != "breaker_open":
                self.observe(operation, result, time.perf_counter() - started)

    async def read(self, keys: Sequence[bytes]) -> list[Versioned | None]:
        kv = self._kv
        # A transaction with no comparisons: every range read at the same revision.
        reply = await self._call(
            "read",
            lambda: kv.txn([], [kv.txn_op_get(key) for key in keys], timeout=self._timeout()),
        )
        return [_first(response.response_range.kvs) for response in reply.responses]

    async def read_prefix(self, prefix: bytes) -> list[tuple[bytes, Versioned]]:
        import etcd3aio

        reply = await self._call(
            "read_prefix",
            lambda: self._kv.get(
                prefix, range_end=etcd3aio.prefix_range_end(prefix), timeout=self._timeout()
            ),
        )
        return [(kv.key, Versioned(kv.value, kv.mod_revision)) for kv in reply.kvs]

    async def write_if_unchanged(
        self,
        expected: dict[bytes, int],
        puts: dict[bytes, bytes],
        lease_id: int,
        reread: Sequence[bytes] = (),
    ) -> tuple[int | None, list[Versioned | None]]:
        from etcd3aio._protobuf import Compare

        kv = self._kv
        compares = [
            Compare(result=Compare.EQUAL, target=Compare.MOD, key=key, mod_revision=revision)
            for key, revision in expected.items()
        ]
        operations = [kv.txn_op_put(key, value, lease=lease_id) for key, value in puts.items()]
        on_conflict = [kv.txn_op_get(key) for key in reread]
        reply = await self._call(
            "write",
            lambda: kv.txn(compares, operations, on_conflict, timeout=self._timeout()),
        )
        if reply.succeeded:
            return reply.header.revision, []
        return None, [_first(r.response_range.kvs) for r in reply.responses]

    async def grant_lease(self, ttl_s: int) -> int:
        reply = await self._call(
            "lease grant", lambda: self._lease.grant(ttl_s, timeout=self._timeout())
        )
        return reply.ID

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call(
            "lease revoke", lambda: self._lease.revoke(lease_id, timeout=self._timeout())
        )

    async def ping(self) -> None:
        await self._call("ping", lambda: self._kv.get(self._ping_key, timeout=self._timeout()))


def etcd_target(endpoints: Sequence[str]) -> str:
    """The gRPC target of etcd's client endpoints: IP literals as a static `ipv4:`/`ipv6:`
    list; one DNS name as `dns:///name:port`. Several names cannot be one target."""
    hosts = [endpoint.rpartition(":")[0].strip("[]") for endpoint in endpoints]
    families: set[int | str] = set()  # 4, 6, or "name"
    for host in hosts:
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            families.add("name")
    if families == {4}:
        return "ipv4:" + ",".join(endpoints)
    if families == {6}:
        return "ipv6:" + ",".join(endpoints)
    if families == {"name"} and len(endpoints) == 1:
        return f"dns:///{endpoints[0]}"
    raise ConfigError(
        f"RAGLINE_BUDGET_ETCD_ENDPOINTS={','.join(endpoints)}: give IP addresses, or one DNS "
        "name that resolves to every member (a headless Service), not several names or a mix"
    )


def _is_silence(error: Exception) -> bool:
    """etcd did not answer (as opposed to answering with an error)."""
    import etcd3aio

    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(
        error, TimeoutError | etcd3aio.EtcdConnectionError | etcd3aio.EtcdTransientError
    )


def _first(kvs) -> Versioned | None:
    return Versioned(kvs[0].value, kvs[0].mod_revision) if kvs else None
