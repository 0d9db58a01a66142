"""Dynamic micro-batching: concurrent requests share one model run.

Requests queue with their deadline, one queue per tenant. A batch forms as soon as the
model is free: it takes queued requests up to `max_batch_texts` texts, one request per
tenant in turn (round robin), waiting at most `max_wait_s` after the oldest one for more
to arrive. So a tenant that floods the batcher delays another tenant's request by about one
of its own requests, never by its whole backlog. Requests whose caller went away or whose
deadline passed are dropped before compute. Inside a batch the texts are sorted by token
length and run in length buckets, each padded only to its own longest text. Up to
`max_parallel_runs` batches run at once (a CPU model with one thread per run: one per
core), so a bulk load keeps every core busy; a batch of several runs (a model that runs one
text at a time) borrows the runners nobody waits for. A full queue
(all tenants: `max_queue_texts`; one tenant: `max_queue_texts_per_tenant`, smaller, so one
tenant cannot fill it for everyone) refuses at once with RESOURCE_EXHAUSTED and a retry
delay instead of letting callers time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ragline import tracing
from ragline.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from ragline.fair_queue import FairQueue
from ragline.tokenization import TokenizedText

# Runs the model on one length bucket: its texts in, one row per text out. The batcher
# knows nothing of tensor layouts (single texts, query-passage pairs, type ids).
RunBatch = Callable[[Sequence[TokenizedText]], Awaitable[np.ndarray]]

URGENT, BULK = 0, 1
LANE_NAMES = {URGENT: "urgent", BULK: "bulk"}


class BatchObserver(Protocol):
    """Told of every model run (the process's metrics, when it serves them)."""

    def batch_ran(
        self, batcher: str, lane: str, texts: int, run_s: float, waits: Iterable[float]
    ) -> None: ...


# Token-length bucket edges: texts of one bucket are padded to the bucket's longest text.
DEFAULT_BUCKETS = (8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512)


@dataclass
class BatchResult:
    # One model output per text of the request, in order (a vector, a score, a matrix of
    # token vectors: whatever the run returns for a text, hence Any).
    rows: list[Any]
    enqueued: float
    batch_started: float
    compute_s: float
    batch_texts: int

    @property
    def queue_wait_s(self) -> float:
        return self.batch_started - self.enqueued

    @property
    def vectors(self) -> np.ndarray:
        """The rows as one array (when every text's output has the same shape)."""
        return np.stack(self.rows)


@dataclass
class _Item:
    texts: Sequence[TokenizedText]
    deadline: float | None
    enqueued: float
    future: asyncio.Future[BatchResult] = field(repr=False)
    tenant: str = ""


def bucket_groups(
    lengths: Sequence[int], max_batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS
) -> list[list[int]]:
    """Indexes of texts grouped by length bucket (sorted by length), at most max_batch each."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    current_bucket = None
    for index in order:
        bucket = next((edge for edge in buckets if lengths[index] <= edge), None)
        if current and (bucket != current_bucket or len(current) >= max_batch):
            groups.append(current)
            current = []
        current.append(index)
        current_bucket = bucket
    if current:
        groups.append(current)
    return groups


def pad(texts: Sequence[TokenizedText]) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask of `texts`, padded to the longest."""
    width = max(t.length for t in texts)
    ids = np.zeros((len(texts), width), dtype=np.int64)
    mask = np.zeros((len(texts), width), dtype=np.int64)
    for row, text in enumerate(texts):
        ids[row, : text.length] = text.ids
        mask[row, : text.length] = 1
    return ids, mask


def pad_pairs(texts: Sequence[TokenizedText]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, attention_mask and token_type_ids of encoded pairs, padded."""
    ids, mask = pad(texts)
    types = np.zeros_like(ids)
    for row, text in enumerate(texts):
        if text.type_ids is not None:
            types[row, : text.length] = text.type_ids
    return ids, mask, types


class MicroBatcher:
    def __init__(
        self,
        run: RunBatch,
        *,
        max_batch_texts: int = 32,
        max_wait_s: float = 0.001,
        max_queue_texts: int = 2048,
        max_queue_texts_per_tenant: int | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        name: str = "batcher",
        max_parallel_runs: int = 1,
        max_bulk_batch_texts: int | None = None,
    ) -> None:
        """`max_parallel_runs`: batches run at once (the model's runners: cores for a
        one-thread-per-run CPU model); the next batch forms as soon as one is free.
        `max_bulk_batch_texts` (default `max_batch_texts`): texts per batch of bulk work,
        kept small so that a query arriving while every runner is busy with bulk work
        waits for one short run (a request larger than it still runs whole)."""
        self._run = run
        self.name = name
        self.max_parallel_runs = max(1, max_parallel_runs)
        self._runners = asyncio.Semaphore(self.max_parallel_runs)
        self._running: set[asyncio.Task[None]] = set()
        self._lent = 0  # runners lent to running batches (`_borrow_idle_runners`)
        self.max_batch_texts = max_batch_texts
        self.max_bulk_batch_texts = max_bulk_batch_texts or max_batch_texts
        self.max_wait_s = max_wait_s
        self._buckets = buckets
        # Waiting requests by (lane, tenant); the dict's order is the round-robin order.
        # Lane URGENT (queries someone waits on) is served before lane BULK (passages).
        self._queue: FairQueue[tuple[int, str], _Item] = FairQueue(
            max_queue_texts,
            max_queue_texts_per_tenant or max(max_queue_texts // 2, 1),
            size=lambda item: len(item.texts),
            tenant_of=lambda key: key[1],
        )
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Recent throughput, for the retry hint of a full queue.
        self._texts_per_s = 100.0
        self.batches = 0
        # Requests dropped before compute, by why (cancelled, deadline); refused at once,
        # by whose queue was full (tenant, all).
        self.dropped: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.observer: BatchObserver | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for item in self._queue.drain():
            if not item.future.done():
                item.future.set_exception(
                    Unavailable(f"{self.name} is shutting down", reason="SHUTTING_DOWN")
                )

    @property
    def queued_texts(self) -> int:
        return self._queue.waiting

    def queued_texts_of(self, tenant: str) -> int:
        return self._queue.waiting_of(tenant)

    @property
    def runs_in_flight(self) -> int:
        """Model runs going on: one per batch, and the runners lent to them."""
        return len(self._running) + self._lent

    def _refuse(self, waiting: int, limit: int, whose: str) -> ResourceExhausted:
        backlog_s = waiting / max(self._texts_per_s, 1.0)
        self.refusals["tenant" if whose == "this tenant" else "all"] += 1
        return ResourceExhausted(
            f"{self.name} queue is full for {whose} ({waiting} texts waiting, limit {limit}); "
            f"retry in about {backlog_s * 1000:.0f} ms",
            retry_after_s=backlog_s,
            reason="QUEUE_FULL",
            metadata={"queue": self.name, "scope": "tenant" if whose == "this tenant" else "all"},
        )

    async def submit(
        self,
        texts: Sequence[TokenizedText],
        deadline: float | None,
        tenant: str = "",
        *,
        urgent: bool = False,
    ) -> BatchResult:
        """`urgent`: a request someone waits on (a query), run before bulk work (passages
        of an ingest), in batches of its own lane."""
        scope = self._queue.over_cap(tenant, len(texts))
        if scope == "tenant":
            mine = self._queue.waiting_of(tenant)
            raise self._refuse(mine, self._queue.max_per_tenant, "this tenant")
        if scope == "all":
            raise self._refuse(self._queue.waiting, self._queue.max_total, "all tenants")
        future: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        self._queue.push(
            (URGENT if urgent else BULK, tenant),
            _Item(texts, deadline, time.monotonic(), future, tenant),
        )
        self._wakeup.set()
        try:
            result = await future
        except asyncio.CancelledError:
            future.cancel()  # the batcher drops a cancelled item before compute
            raise
        if tracing.sampled():
            # The model run the request shared, a child of its call; the wait before it is
            # the gap to the call's start (one span, not two: spans cost CPU per request).
            tracing.record(
                f"{self.name} model run",
                result.batch_started,
                result.batch_started + result.compute_s,
                {
                    "ragline.batch_texts": result.batch_texts,
                    "ragline.queue_wait_ms": round(result.queue_wait_s * 1000, 3),
                },
            )
        return result

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                # A batch forms only once a runner is free: what arrives meanwhile joins it.
                await self._runners.acquire()
                batch: list[_Item] = []
                lane = URGENT
                try:
                    if self._queue:
                        await self._gather()
                        batch, lane = self._take()
                finally:
                    if not batch:
                        self._runners.release()
                if batch:
                    task = asyncio.ensure_future(self._run_batch(batch, lane))
                    self._running.add(task)
                    task.add_done_callback(self._batch_done)

    async def _borrow_idle_runners(self, wanted: int) -> int:
        """Takes up to `wanted` runners nobody waits for (none while work is queued), so
        that a batch of several runs (a request of several texts, for a model that runs
        one text at a time) uses the cores that would otherwise idle: 6 sentences of an
        evidence step on 2 runners take 3 runs' time, not 6. A lent runner goes back as
        soon as other work queues (after the run it is in), so the lending never makes
        another request wait longer than one run."""
        borrowed = 0
        while borrowed < wanted and not self._queue and not self._runners.locked():
            await self._runners.acquire()  # free and unwaited for: returns at once
            borrowed += 1
        self._lent += borrowed
        return borrowed

    def _give_back(self, loan: list[int]) -> None:
        """One runner of a batch's `loan` (a count of one item) handed back."""
        if loan[0]:
            loan[0] -= 1
            self._lent -= 1
            self._runners.release()

    async def _run_groups(
        self,
        flat: list[TokenizedText],
        groups: list[list[int]],
        rows: list[np.ndarray | None],
        loan: list[int],
    ) -> None:
        """Runs each group of `flat`, filling `rows`: on the batch's own runner and on the
        `loan[0]` lent ones, each handed back after `_borrow_idle_runners`' rule (the
        caller hands back whatever is still lent when this ends, however it ends)."""
        shared = iter(groups)  # each runner takes the next group left

        async def run_each(on_loan: bool) -> None:
            for group in shared:
                result = await self._run([flat[i] for i in group])
                for position, index in enumerate(group):
                    rows[index] = result[position]
                if on_loan and self._queue:
                    break  # someone waits: the batch's own runner does the rest
            if on_loan:
                self._give_back(loan)

        if not loan[0]:
            await run_each(False)
            return
        try:
            async with asyncio.TaskGroup() as runs:
                runs.create_task(run_each(False))
                for _ in range(loan[0]):
                    runs.create_task(run_each(True))
        except ExceptionGroup as failed:  # the model's own error, as a lone run raises it
            raise failed.exceptions[0] from None

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._runners.release()

    async def _gather(self) -> None:
        """Waits (at most max_wait after the oldest request) for the batch to fill."""
        oldest = min(self._queue.head(key).enqueued for key in self._queue.keys())
        wait_until = oldest + self.max_wait_s
        while self._queue.waiting < self.max_batch_texts:
            left = wait_until - time.monotonic()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return

    def _next_key(self) -> tuple[int, str]:
        """The first tenant in the round with urgent work, else the first one."""
        first = None
        for key in self._queue.keys():
            if key[0] == URGENT:
                return key
            first = first or key
        assert first is not None  # called with work waiting
        return first

    def _take(self) -> tuple[list[_Item], int]:
        """The next batch and its lane."""
        batch: list[_Item] = []
        texts = 0
        now = time.monotonic()
        lane = None
        while self._queue:
            key = self._next_key()
            if lane is not None and key[0] != lane:
                break  # urgent and bulk work never share a run (a query would wait for it)
            head = self._queue.head(key)
            limit = self.max_bulk_batch_texts if key[0] == BULK else self.max_batch_texts
            if batch and texts + len(head.texts) > limit:
                break
            # The tenant goes to the back of the round: the next batch starts with another.
            item = self._queue.pop(key)
            if item.future.done():  # cancelled by its caller
                self.dropped["cancelled"] += 1
                continue
            if item.deadline is not None and item.deadline <= now:
                self.dropped["deadline"] += 1
                item.future.set_exception(
                    DeadlineExceeded(
                        f"deadline passed after {(now - item.enqueued) * 1000:.0f} ms in the "
                        f"{self.name} queue, before compute"
                    )
                )
                continue
            batch.append(item)
            texts += len(item.texts)
            lane = key[0]
        return batch, URGENT if lane is None else lane

    async def _run_batch(self, batch: list[_Item], lane: int = URGENT) -> None:
        started = time.monotonic()
        flat = [text for item in batch for text in item.texts]
        rows: list[np.ndarray | None] = [None] * len(flat)
        groups = bucket_groups([t.length for t in flat], self.max_batch_texts, self._buckets)
        loan = [await self._borrow_idle_runners(len(groups) - 1)]
        try:
            await self._run_groups(flat, groups, rows, loan)
        except Exception as error:  # the model failed: every request of the batch fails
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        except asyncio.CancelledError:  # stopped mid-batch: no caller is left waiting
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(
                        Unavailable(f"{self.name} is shutting down", reason="SHUTTING_DOWN")
                    )
            raise
        finally:
            while loan[0]:
                self._give_back(loan)
        compute_s = time.monotonic() - started
        self.batches += 1
        if self.observer is not None:
            self.observer.batch_ran(
                self.name,
                LANE_NAMES[lane],
                len(flat),
                compute_s,
                (started - item.enqueued for item in batch),
            )
        # The service's rate: this batch's, times the batches running beside it.
        rate = len(flat) / max(compute_s, 1e-6) * max(1, len(self._running))
        self._texts_per_s = 0.8 * self._texts_per_s + 0.2 * rate
        offset = 0
        for item in batch:
            count = len(item.texts)
            if not item.future.done():
                item.future.set_result(
                    BatchResult(
                        rows[offset : offset + count],
                        item.enqueued,
                        started,
                        compute_s,
                        len(flat),
                    )
                )
            offset += count
