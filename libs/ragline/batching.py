"""Dynamic micro-batching: concurrent requests share one model run.

Requests queue with their deadline. A batch forms as soon as the model is free: it takes
queued requests up to `max_batch_texts` texts, waiting at most `max_wait_s` after the
oldest one for more to arrive. Requests whose caller went away or whose deadline passed
are dropped before compute. Inside a batch the texts are sorted by token length and run
in length buckets, each padded only to its own longest text. A full queue refuses at once
(RESOURCE_EXHAUSTED with a retry delay) instead of letting callers time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline.tokenization import TokenizedText

# Runs the model on one length bucket: its texts in, one row per text out. The batcher
# knows nothing of tensor layouts (single texts, query-passage pairs, type ids).
RunBatch = Callable[[Sequence[TokenizedText]], Awaitable[np.ndarray]]

# Token-length bucket edges: texts of one bucket are padded to the bucket's longest text.
DEFAULT_BUCKETS = (8, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512)


@dataclass
class BatchResult:
    # One model output per text of the request, in order (a vector, a score, a matrix of
    # token vectors: whatever the run returns for a text).
    rows: list[np.ndarray]
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
    future: asyncio.Future = field(repr=False)


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
        buckets: Sequence[int] = DEFAULT_BUCKETS,
    ) -> None:
        self._run = run
        self.max_batch_texts = max_batch_texts
        self.max_wait_s = max_wait_s
        self.max_queue_texts = max_queue_texts
        self._buckets = buckets
        self._queue: deque[_Item] = deque()
        self._queued_texts = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Recent throughput, for the retry hint of a full queue.
        self._texts_per_s = 100.0
        self.batches = 0
        self.dropped = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="embedding-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(ResourceExhausted("embedding service is shutting down"))
        self._queue.clear()

    @property
    def queued_texts(self) -> int:
        return self._queued_texts

    async def submit(self, texts: Sequence[TokenizedText], deadline: float | None) -> BatchResult:
        if self._queued_texts + len(texts) > self.max_queue_texts:
            backlog_s = self._queued_texts / max(self._texts_per_s, 1.0)
            raise ResourceExhausted(
                f"embedding queue is full ({self._queued_texts} texts waiting, limit "
                f"{self.max_queue_texts}); retry in about {backlog_s * 1000:.0f} ms",
                retry_after_s=backlog_s,
            )
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Item(texts, deadline, time.monotonic(), future))
        self._queued_texts += len(texts)
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            future.cancel()  # the batcher drops a cancelled item before compute
            raise

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await self._gather()
                batch = self._take()
                if batch:
                    await self._run_batch(batch)

    async def _gather(self) -> None:
        """Waits (at most max_wait after the oldest request) for the batch to fill."""
        wait_until = self._queue[0].enqueued + self.max_wait_s
        while self._queued_texts < self.max_batch_texts:
            left = wait_until - time.monotonic()
            if left <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        texts = 0
        now = time.monotonic()
        while self._queue:
            item = self._queue[0]
            if batch and texts + len(item.texts) > self.max_batch_texts:
                break
            self._queue.popleft()
            self._queued_texts -= len(item.texts)
            if item.future.done():  # cancelled by its caller
                self.dropped += 1
                continue
            if item.deadline is not None and item.deadline <= now:
                self.dropped += 1
                item.future.set_exception(
                    DeadlineExceeded(
                        f"deadline passed after {(now - item.enqueued) * 1000:.0f} ms in the "
                        "embedding queue, before compute"
                    )
                )
                continue
            batch.append(item)
            texts += len(item.texts)
        return batch

    async def _run_batch(self, batch: list[_Item]) -> None:
        started = time.monotonic()
        flat = [text for item in batch for text in item.texts]
        rows: list = [None] * len(flat)
        try:
            for group in bucket_groups(
                [t.length for t in flat], self.max_batch_texts, self._buckets
            ):
                result = await self._run([flat[i] for i in group])
                for position, index in enumerate(group):
                    rows[index] = result[position]
        except Exception as error:  # the model failed: every request of the batch fails
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        compute_s = time.monotonic() - started
        self.batches += 1
        self._texts_per_s = 0.8 * self._texts_per_s + 0.2 * (len(flat) / max(compute_s, 1e-6))
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
