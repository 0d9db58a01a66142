"""Client-side batching of budget calls: what a process's tasks send in the same turn of
the event loop goes to the budget service as one `Batch` call.

Nothing waits to fill a batch. The first call of a turn schedules the send for the end of
that turn, so a lone call goes out at once, and calls made together (the workers that one
reply woke up, the parallel steps of a plan) share one message: per pair of calls the
service's gRPC machinery then runs once per batch instead of once per call, which is
where most of a replica's CPU went.

Each caller keeps its own deadline and gets its own answer, or the `AioRpcError` its own
call would have raised (same code, message and google.rpc details in the trailers), so
the kit's retry rule and every caller's error handling work unchanged. A caller that gives
up (its deadline, a cancel) does not stop the batch the others share, so a reservation
granted after its caller left is released at once (settled with no use), as the server
would have dropped a cancelled call of its own. Calls are grouped by the identity they
carry (tenant, principal, credential): a batch never mixes callers.
A server without `Batch` (UNIMPLEMENTED: an older replica) is called one call at a time
from then on.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from ragline import deadlines, identity
from ragline.clients import ServiceClient

if TYPE_CHECKING:
    from ragline.v1 import budget_pb2

Metadata = tuple[tuple[str, str], ...]
# Calls that may share a batch: same event loop (its id), same identity metadata.
BatchKey = tuple[int, Metadata]

# Method -> the BatchItem / BatchResult field that carries it.
BATCHED_METHODS = {"Reserve": "reserve", "Settle": "settle", "Cancel": "cancel"}
# The contract's cap on BatchRequest.items.
MAX_BATCH_ITEMS = 64
# Time a release of an abandoned reservation may take (bookkeeping after the caller left).
RELEASE_TIMEOUT_S = 5.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Per-call metadata that must not split a batch (the batch carries its first call's).
_NOT_IN_KEY = (identity.RUN_ID_KEY, deadlines.TIMEOUT_METADATA_KEY, "traceparent", "tracestate")


class _SendAlone(Exception):
    """The server has no Batch: the caller makes its own call."""


@dataclass(eq=False)
class _Queued:
    kind: str  # the BatchItem field: reserve, settle or cancel
    request: Any  # that field's message (ReserveRequest, SettleRequest, CancelRequest)
    timeout: float | None
    run_id: str
    future: asyncio.Future[Any]  # the reply message of `kind`
    expiry: asyncio.TimerHandle | None = field(default=None)


def item_error(status: budget_pb2.ItemStatus) -> grpc.aio.AioRpcError:
    """The error the item's own call would have raised, from its ItemStatus."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    rich = status_pb2.Status(code=status.code, message=status.message, details=status.details)
    trailing = grpc.aio.Metadata((rpc_status.GRPC_DETAILS_METADATA_KEY, rich.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=status.message)


def _local_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error decided on this side (no trailers from the server)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class BudgetCallBatcher:
    """Reserve / Settle / Cancel through `Batch` calls of one budget-service client."""

    def __init__(self, client: ServiceClient, *, max_items: int = MAX_BATCH_ITEMS) -> None:
        self.client = client
        self.max_items = max(1, min(max_items, MAX_BATCH_ITEMS))
        self.unbatched = False  # the server answered UNIMPLEMENTED to Batch
        self._queued: dict[BatchKey, list[_Queued]] = {}  # this turn's calls
        self._sending: set[asyncio.Task[None]] = set()  # batches and releases in flight
        self.batches_sent = 0
        self.items_sent = 0
        self.released = 0  # reservations granted after their caller left, released

    async def call(self, method: str, request: Any) -> Any:
        """One call's answer (its response message), or the error its own call would raise."""
        kind = BATCHED_METHODS[method]
        if self.unbatched:
            return await self.client.unary(method, request)
        timeout, metadata = self.client.call_options(method, None)
        loop = asyncio.get_running_loop()
        key: BatchKey = (id(loop), tuple(kv for kv in metadata if kv[0] not in _NOT_IN_KEY))
        run_id = next((v for k, v in metadata if k == identity.RUN_ID_KEY), "")
        queued = _Queued(kind, request, timeout, run_id, loop.create_future())
        if timeout is not None:
            queued.expiry = loop.call_later(timeout, self._expire, queued)
        batch = self._queued.get(key)
        if batch is None:
            batch = self._queued[key] = []
            loop.call_soon(self._flush, key)
        batch.append(queued)
        try:
            return await queued.future
        except _SendAlone:
            return await self.client.unary(method, request)
        finally:
            if queued.expiry is not None:
                queued.expiry.cancel()

    @staticmethod
    def _expire(queued: _Queued) -> None:
        if not queued.future.done():
            queued.future.set_exception(
                _local_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"BudgetService.{queued.kind}: the deadline passed before the batch answered",
                )
            )

    def _flush(self, key: BatchKey) -> None:
        batch = [q for q in self._queued.pop(key, []) if not q.future.done()]
        for start in range(0, len(batch), self.max_items):
            self._spawn(self._send(key[1], batch[start : start + self.max_items]))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, identity_metadata: Metadata, batch: list[_Queued]) -> None:
        from ragline.v1 import budget_pb2

        timeouts = [q.timeout for q in batch]
        # The longest wait any caller allows: each caller's own deadline is kept by its
        # own timer, so a short one never cuts the others' call short.
        bounded = [t for t in timeouts if t is not None]
        timeout = max(bounded) if len(bounded) == len(timeouts) else None
        # One run's calls carry its id; a batch of several runs' calls carries none.
        run_ids = {q.run_id for q in batch}
        run_id = ((identity.RUN_ID_KEY, run_ids.pop()),) if len(run_ids) == 1 else ()
        metadata = (*identity_metadata, *run_id, *deadlines.timeout_metadata(timeout))
        request = budget_pb2.BatchRequest(
            items=[budget_pb2.BatchItem(**{q.kind: q.request}) for q in batch]
        )
        try:
            reply = await self.client.stub().Batch(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            failure: Exception = error
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unbatched = True
                failure = _SendAlone()
            for queued in batch:
                if not queued.future.done():
                    queued.future.set_exception(failure)
            return
        except BaseException as error:  # no answer will come: nobody may wait for one
            for queued in batch:
                if queued.future.done():
                    continue
                if isinstance(error, Exception):
                    queued.future.set_exception(error)
                else:
                    queued.future.cancel()
            raise
        self.batches_sent += 1
        self.items_sent += len(batch)
        for queued, result in zip(batch, reply.results, strict=False):
            if queued.future.done():  # its caller gave up (deadline, cancel)
                if queued.kind == "reserve" and result.WhichOneof("result") == "reserve":
                    self._spawn(self._release(identity_metadata, queued.request))
                continue
            if result.WhichOneof("result") == "error":
                queued.future.set_exception(item_error(result.error))
            else:
                queued.future.set_result(getattr(result, queued.kind))
        for queued in batch[len(reply.results) :]:
            if not queued.future.done():
                queued.future.set_exception(
                    _local_error(
                        grpc.StatusCode.INTERNAL,
                        "BudgetService.Batch answered fewer results than items",
                    )
                )

    async def _release(
        self, identity_metadata: Metadata, reserve: budget_pb2.ReserveRequest
    ) -> None:
        """Settles, with no use, a reservation whose caller left before it was granted
        (what `Reservation` itself settles on a cancel; the same request, so either one
        landing second is a replay)."""
        from ragline.v1 import budget_pb2

        settle = budget_pb2.SettleRequest(
            task_id=reserve.task_id, reservation_id=reserve.reservation_id
        )
        metadata = (*identity_metadata, *deadlines.timeout_metadata(RELEASE_TIMEOUT_S))
        try:
            await self.client.stub().Batch(
                budget_pb2.BatchRequest(items=[budget_pb2.BatchItem(settle=settle)]),
                timeout=RELEASE_TIMEOUT_S,
                metadata=metadata,
            )
        except grpc.aio.AioRpcError:
            return  # the task's records expire with its lease (deadline + grace)
        self.released += 1


_batchers: weakref.WeakKeyDictionary[ServiceClient, BudgetCallBatcher] = weakref.WeakKeyDictionary()


def batcher_for(client: ServiceClient) -> BudgetCallBatcher:
    """The one batcher of a client, so every TaskBudget over it shares its batches."""
    batcher = _batchers.get(client)
    if batcher is None:
        batcher = _batchers[client] = BudgetCallBatcher(client)
    return batcher
