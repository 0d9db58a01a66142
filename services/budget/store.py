"""The ledger's storage: etcd, used only through revision-guarded transactions.

Every failure to reach etcd becomes UNAVAILABLE (or DEADLINE_EXCEEDED when the caller's
own deadline ran out): the ledger fails closed and never grants without a committed write.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from ragline import deadlines, tracing
from ragline.breaker import Breaker, BreakerOpen
from ragline.errors import DeadlineExceeded, Unavailable


@dataclass(frozen=True)
class Versioned:
    value: bytes
    mod_revision: int


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


_ETCD_SPAN = {"db.system": "etcd"}


class EtcdLedgerStore:
    """LedgerStore on an etcd v3 cluster through etcd3aio (grpc.aio)."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 2.0) -> None:
        import etcd3aio

        self.endpoints = list(endpoints)
        self._timeout_s = timeout_s
        # While etcd does not answer, calls fail at once rather than each waiting
        # `timeout_s` (ragline/breaker.py); the health probe's pings always go.
        self._breaker = Breaker(_is_silence)
        # Told of every etcd operation: its name, "ok" or "error", and its seconds.
        self.observe: Callable[[str, str, float], None] | None = None
        # One retry for a transient blip; more would only delay the UNAVAILABLE answer.
        self._client = etcd3aio.Etcd3Client(self.endpoints, rpc_max_attempts=2)
        # gRPC's default reconnect backoff grows to 120 s; after an etcd restart the ledger
        # must be back within a second, not minutes. (etcd3aio has no public hook for it.)
        self._client._manager.grpc_options.extend(
            [
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
        )

    async def connect(self) -> None:
        await self._client.connect()

    async def close(self) -> None:
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
        kv = self._client.kv
        async with self._guard("read"):
            # A transaction with no comparisons: every range read at the same revision.
            reply = await kv.txn([], [kv.txn_op_get(key) for key in keys], timeout=self._timeout())
        return [_first(response.response_range.kvs) for response in reply.responses]

    async def read_prefix(self, prefix: bytes) -> list[tuple[bytes, Versioned]]:
        import etcd3aio

        async with self._guard("read_prefix"):
            reply = await self._client.kv.get(
                prefix, range_end=etcd3aio.prefix_range_end(prefix), timeout=self._timeout()
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

        kv = self._client.kv
        compares = [
            Compare(result=Compare.EQUAL, target=Compare.MOD, key=key, mod_revision=revision)
            for key, revision in expected.items()
        ]
        operations = [kv.txn_op_put(key, value, lease=lease_id) for key, value in puts.items()]
        on_conflict = [kv.txn_op_get(key) for key in reread]
        async with self._guard("write"):
            reply = await kv.txn(compares, operations, on_conflict, timeout=self._timeout())
        if reply.succeeded:
            return reply.header.revision, []
        return None, [_first(r.response_range.kvs) for r in reply.responses]

    async def grant_lease(self, ttl_s: int) -> int:
        async with self._guard("lease grant"):
            reply = await self._client.lease.grant(ttl_s, timeout=self._timeout())
        return reply.ID

    async def revoke_lease(self, lease_id: int) -> None:
        async with self._guard("lease revoke"):
            await self._client.lease.revoke(lease_id, timeout=self._timeout())

    async def ping(self) -> None:
        async with self._guard("ping"):
            await self._client.kv.get(b"/ragline/ping", timeout=self._timeout())


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
