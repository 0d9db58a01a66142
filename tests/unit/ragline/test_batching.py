"""Micro-batcher behaviour with a fake model (the real model is in the integration tests)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from ragline.batching import MicroBatcher, bucket_groups, pad
from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline.metrics import ProcessMetrics
from ragline.tokenization import TokenizedText


def text(*ids: int) -> TokenizedText:
    return TokenizedText(np.asarray(ids, dtype=np.int64), truncated=False)


class FakeModel:
    """vector = [sum of real token ids, count of real tokens]: wrong if padding leaks."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []
        self.delay_s = delay_s
        self.fail = fail

    async def __call__(self, texts) -> np.ndarray:
        ids, mask = pad(texts)
        self.calls.append(ids.shape)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("model crashed")
        return np.stack([(ids * mask).sum(axis=1), mask.sum(axis=1)], axis=1).astype(np.float32)


def test_bucket_groups_sort_split_and_cap():
    lengths = [100, 3, 40, 5, 300, 7]
    groups = bucket_groups(lengths, max_batch=2)
    assert groups == [[1, 3], [5], [2], [0], [4]]
    assert sorted(i for g in groups for i in g) == list(range(6))


def test_pad_masks_padding():
    ids, mask = pad([text(1, 2, 3), text(4)])
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


async def test_concurrent_requests_share_one_run_and_get_their_own_vectors():
    model = FakeModel()
    batcher = MicroBatcher(model, max_batch_texts=32, max_wait_s=0.05)
    await batcher.start()
    requests = [[text(i, 1)] for i in range(1, 6)] + [[text(7, 7, 7), text(9)]]
    results = await asyncio.gather(*(batcher.submit(r, None) for r in requests))
    await batcher.stop()
    assert len(model.calls) == 1  # every text falls in the shortest length bucket
    for request, result in zip(requests, results, strict=True):
        expected = [[t.ids.sum(), t.length] for t in request]
        assert result.vectors.tolist() == expected
        assert result.batch_texts == 7
        assert result.queue_wait_s >= 0


async def test_unbatched_runs_one_text_at_a_time():
    model = FakeModel()
    batcher = MicroBatcher(model, max_batch_texts=1, max_wait_s=0)
    await batcher.start()
    await asyncio.gather(*(batcher.submit([text(i)], None) for i in range(1, 5)))
    await batcher.stop()
    assert model.calls == [(1, 1)] * 4


async def test_expired_and_cancelled_requests_are_dropped_before_compute():
    model = FakeModel(delay_s=0.05)
    batcher = MicroBatcher(model, max_batch_texts=1, max_wait_s=0)
    await batcher.start()
    busy = asyncio.create_task(batcher.submit([text(1)], None))  # occupies the model
    await asyncio.sleep(0.01)
    expired = asyncio.create_task(batcher.submit([text(2)], time.monotonic() + 0.01))
    cancelled = asyncio.create_task(batcher.submit([text(3)], None))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await busy
    with pytest.raises(DeadlineExceeded, match="before compute"):
        await expired
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.sleep(0.01)
    await batcher.stop()
    assert model.calls == [(1, 1)]
    assert batcher.dropped == {"deadline": 1, "cancelled": 1}


async def test_full_queue_refuses_at_once_with_a_retry_hint():
    model = FakeModel(delay_s=0.2)
    batcher = MicroBatcher(
        model, max_batch_texts=1, max_wait_s=0, max_queue_texts=2, max_queue_texts_per_tenant=2
    )
    await batcher.start()
    first = asyncio.create_task(batcher.submit([text(1)], None))
    await asyncio.sleep(0.01)  # taken by the model; the queue is empty again
    queued = [asyncio.create_task(batcher.submit([text(i)], None)) for i in (2, 3)]
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted) as caught:
        await batcher.submit([text(4)], None)
    # Refused at once: while the model still runs the first text, not after waiting for room.
    assert not first.done() and len(model.calls) == 1
    assert caught.value.retry_after_s is not None
    await asyncio.gather(first, *queued)
    await batcher.stop()


async def test_a_flooding_tenant_neither_fills_the_queue_nor_delays_another_much():
    model = FakeModel(delay_s=0.01)
    batcher = MicroBatcher(
        model, max_batch_texts=2, max_wait_s=0, max_queue_texts=40, max_queue_texts_per_tenant=20
    )
    await batcher.start()
    flood = [asyncio.create_task(batcher.submit([text(i)], None, "noisy")) for i in range(20)]
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted, match="this tenant"):
        await batcher.submit([text(99)], None, "noisy")  # its own limit, not everyone's
    done_before = []
    for task in flood:
        task.add_done_callback(lambda _, done=done_before: done.append(1))
    quiet = await batcher.submit([text(7)], None, "quiet")  # room was left for it
    # Served within the first batches (round robin), not after the flood's 20 texts.
    assert len(done_before) <= 4 and len(quiet.rows) == 1
    await asyncio.gather(*flood)
    await batcher.stop()


async def test_a_model_failure_fails_every_request_of_the_batch():
    batcher = MicroBatcher(FakeModel(fail=True), max_batch_texts=8, max_wait_s=0.02)
    await batcher.start()
    results = await asyncio.gather(
        batcher.submit([text(1)], None), batcher.submit([text(2)], None), return_exceptions=True
    )
    await batcher.stop()
    assert all(isinstance(r, RuntimeError) for r in results)


class ConcurrencyModel(FakeModel):
    """Records how many runs were in progress at once."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        self.running = 0
        self.most_at_once = 0

    async def __call__(self, texts) -> np.ndarray:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            return await super().__call__(texts)
        finally:
            self.running -= 1


@pytest.mark.parametrize("runners", [1, 2, 3])
async def test_batches_run_in_parallel_up_to_the_runners_and_stay_correct(runners):
    model = ConcurrencyModel(delay_s=0.05)
    # One text per batch: each request forms a batch of its own.
    batcher = MicroBatcher(model, max_batch_texts=1, max_wait_s=0, max_parallel_runs=runners)
    await batcher.start()
    requests = [[text(i, i + 1)] for i in range(1, 7)]
    results = await asyncio.gather(*(batcher.submit(r, None) for r in requests))
    await batcher.stop()
    assert model.most_at_once == runners
    for request, result in zip(requests, results, strict=True):
        ids = request[0].ids
        assert result.vectors.tolist() == [[float(ids.sum()), float(len(ids))]]


@pytest.mark.parametrize("runners", [1, 2, 3])
async def test_one_request_of_several_runs_uses_the_idle_runners(runners):
    """A model run one text at a time: a lone request of 6 texts (an evidence step's
    sentences) takes 6 / runners runs' time, not 6, and each text keeps its own vector."""
    model = ConcurrencyModel(delay_s=0.05)
    batcher = MicroBatcher(model, max_batch_texts=1, max_wait_s=0, max_parallel_runs=runners)
    await batcher.start()
    request = [text(i, i + 1) for i in range(1, 7)]
    result = await batcher.submit(request, None)
    assert model.most_at_once == runners
    assert result.vectors.tolist() == [[float(t.ids.sum()), float(t.length)] for t in request]
    # Every runner was handed back: six more lone requests still run `runners` at once.
    model.most_at_once = 0
    await asyncio.gather(*(batcher.submit([t], None) for t in request))
    await batcher.stop()
    assert model.most_at_once == runners


async def test_a_lent_runner_goes_back_after_one_run_when_another_request_queues():
    """Tenant A's 10 texts on both runners of 2 (0.05 s a run: 0.25 s in all); B's one
    text arriving meanwhile waits about one run, not for A's whole request, and the
    gauge of runs in flight counts the lent runner."""
    model = ConcurrencyModel(delay_s=0.05)
    batcher = MicroBatcher(model, max_batch_texts=1, max_wait_s=0, max_parallel_runs=2)
    await batcher.start()
    first = asyncio.create_task(batcher.submit([text(i) for i in range(1, 11)], None, "a"))
    await asyncio.sleep(0.02)
    assert batcher.runs_in_flight == 2  # A's own runner and the one lent to it
    asked = time.monotonic()
    second = await batcher.submit([text(99)], None, "b")
    waited = time.monotonic() - asked
    result = await first
    await batcher.stop()
    assert waited < 0.15, f"B waited {waited:.2f} s behind A's lent runner"
    assert second.vectors.tolist() == [[99.0, 1.0]]
    assert result.vectors[:, 0].tolist() == list(range(1, 11))
    assert batcher.runs_in_flight == 0


async def test_two_requests_of_several_runs_at_once_share_the_runners_and_keep_their_vectors():
    model = ConcurrencyModel(delay_s=0.05)
    batcher = MicroBatcher(model, max_batch_texts=1, max_wait_s=0, max_parallel_runs=2)
    await batcher.start()
    # Two requests of 4 texts at once: one runner each, never more than there are.
    first, second = [text(i) for i in range(1, 5)], [text(i) for i in range(5, 9)]
    results = await asyncio.gather(batcher.submit(first, None), batcher.submit(second, None))
    await batcher.stop()
    assert model.most_at_once == 2
    assert [r.vectors[:, 0].tolist() for r in results] == [[1, 2, 3, 4], [5, 6, 7, 8]]


async def test_a_failed_run_of_a_request_on_borrowed_runners_fails_it_with_the_models_error():
    batcher = MicroBatcher(
        FakeModel(delay_s=0.01, fail=True), max_batch_texts=1, max_wait_s=0, max_parallel_runs=2
    )
    await batcher.start()
    with pytest.raises(RuntimeError, match="model crashed"):
        await batcher.submit([text(1), text(2), text(3)], None)
    # Its runners came back: the next request is served (and fails the same way).
    with pytest.raises(RuntimeError, match="model crashed"):
        await asyncio.wait_for(batcher.submit([text(4)], None), 1)
    await batcher.stop()


async def test_a_stop_mid_batch_answers_unavailable():
    from ragline.errors import Unavailable

    batcher = MicroBatcher(FakeModel(delay_s=10), max_wait_s=0, max_parallel_runs=2)
    await batcher.start()
    pending = asyncio.ensure_future(batcher.submit([text(1)], None))
    await asyncio.sleep(0.05)  # the batch is running
    await batcher.stop()
    with pytest.raises(Unavailable):
        await pending


async def test_urgent_work_runs_before_queued_bulk_work_and_never_with_it():
    model = FakeModel(delay_s=0.05)
    order: list[str] = []
    batcher = MicroBatcher(model, max_batch_texts=8, max_wait_s=0)
    await batcher.start()

    async def submit(name, texts, urgent):
        await batcher.submit(texts, None, "ann", urgent=urgent)
        order.append(name)

    running = asyncio.ensure_future(submit("bulk-1", [text(1)] * 4, False))
    await asyncio.sleep(0.01)  # bulk-1 is running; the next two queue behind it
    queued_bulk = asyncio.ensure_future(submit("bulk-2", [text(2)] * 2, False))
    await asyncio.sleep(0.001)
    query = asyncio.ensure_future(submit("query", [text(3)], True))
    await asyncio.gather(running, queued_bulk, query)
    await batcher.stop()
    assert order == ["bulk-1", "query", "bulk-2"]  # the same tenant's query jumps the ingest
    # every run held one kind of work: the query ran alone, not padded with passages
    assert model.calls == [(4, 1), (1, 1), (2, 1)]


async def test_bulk_runs_are_capped_smaller_than_query_runs():
    model = FakeModel(delay_s=0.02)
    batcher = MicroBatcher(model, max_batch_texts=8, max_bulk_batch_texts=2, max_wait_s=0)
    await batcher.start()
    blocker = asyncio.ensure_future(batcher.submit([text(9)], None, "ann", urgent=True))
    await asyncio.sleep(0.005)  # the model is busy: what follows queues and forms batches
    bulk = [batcher.submit([text(i)], None, "ann") for i in range(1, 6)]
    queries = [batcher.submit([text(i)], None, "ann", urgent=True) for i in range(10, 14)]
    results = await asyncio.gather(blocker, *bulk, *queries)
    # A bulk request bigger than the cap still runs, whole and alone.
    results.append(await batcher.submit([text(7)] * 3, None, "ann"))
    await batcher.stop()
    # The queued queries share one run; the passages go two at a time.
    assert [shape[0] for shape in model.calls] == [1, 4, 2, 2, 1, 3]
    assert [r.vectors.tolist() for r in results[1:6]] == [[[float(i), 1.0]] for i in range(1, 6)]


async def test_runs_waits_refusals_and_drops_reach_the_process_metrics():
    metrics = ProcessMetrics()
    model = FakeModel(delay_s=0.05)
    batcher = MicroBatcher(
        model, max_batch_texts=4, max_wait_s=0, max_queue_texts_per_tenant=2, name="embedding"
    )
    metrics.batchers.watch(batcher)
    await batcher.start()
    first = asyncio.create_task(batcher.submit([text(1)], None, urgent=True))
    await asyncio.sleep(0.01)  # running
    queued = asyncio.create_task(batcher.submit([text(2), text(3)], None))
    await asyncio.sleep(0.01)

    def value(name: str, **labels) -> float | None:
        return metrics.registry.get_sample_value(name, {"batcher": "embedding", **labels})

    assert value("ragline_batch_queued_texts") == 2
    assert value("ragline_batch_runs_in_flight") == 1
    with pytest.raises(ResourceExhausted):
        await batcher.submit([text(4)], None)
    assert value("ragline_batch_refusals_total", scope="tenant") == 1
    await asyncio.gather(first, queued)
    await batcher.stop()
    assert value("ragline_batch_texts_count", lane="urgent") == 1
    assert value("ragline_batch_texts_sum", lane="bulk") == 2  # one run of both texts
    # the bulk request waited for the urgent run (~50 ms) before its own started
    assert value("ragline_batch_queue_wait_seconds_sum", lane="bulk") >= 0.02
    assert value("ragline_batch_run_seconds_count", lane="bulk") == 1
    assert value("ragline_batch_queued_texts") == 0
