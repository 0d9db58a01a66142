"""Forget notices (forget_notices.py) with stand-in targets: delivered in the background,
merged per tenant, retried while a target is down, given up after their time, bounded."""

from __future__ import annotations

import asyncio

import pytest

from ragline.errors import Unavailable
from ragline_services.retrieval import forget_notices
from ragline_services.retrieval.forget_notices import ForgetNotices, ForgetTarget


class Target:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[tuple[str, list[str]]] = []

    async def forget(self, tenant: str, ids: list[str]) -> None:
        if self.failures:
            self.failures -= 1
            raise Unavailable("rerank: connection refused")
        self.calls.append((tenant, list(ids)))


async def until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (polling a plain counter)
            await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(forget_notices, "FIRST_RETRY_S", 0.01)
    monkeypatch.setattr(forget_notices, "LAST_RETRY_S", 0.05)


async def test_every_target_is_told_each_tenants_ids():
    rerank, generation = Target(), Target()
    notices = ForgetNotices(
        [ForgetTarget("rerank", rerank.forget), ForgetTarget("generation", generation.forget)]
    )
    notices.notify("acme", ["a", "b"])
    notices.notify("acme", ["c"])  # merged with the first while it waits
    notices.notify("globex", ["a"])
    notices.start()
    await until(lambda: notices.counts.delivered == 4)
    for target in (rerank, generation):
        assert sorted(target.calls) == [("acme", ["a", "b", "c"]), ("globex", ["a"])]
    assert notices.counts.pending_ids == 0
    await notices.stop()


async def test_a_target_that_is_down_is_tried_again_until_it_takes_them():
    rerank = Target(failures=3)
    notices = ForgetNotices([ForgetTarget("rerank", rerank.forget)])
    notices.start()
    notices.notify("acme", ["a"])
    await until(lambda: notices.counts.delivered == 1)
    assert rerank.calls == [("acme", ["a"])]
    assert notices.counts.retried == 3
    await notices.stop()


async def test_a_notice_is_given_up_after_its_time_and_a_later_one_still_goes():
    rerank = Target(failures=1_000_000)
    notices = ForgetNotices([ForgetTarget("rerank", rerank.forget)], retry_for_s=0.2)
    notices.start()
    notices.notify("acme", ["a"])
    await until(lambda: notices.counts.given_up == 1)
    assert notices.counts.pending_ids == 0
    rerank.failures = 0
    notices.notify("acme", ["b"])
    await until(lambda: notices.counts.delivered == 1)
    assert rerank.calls == [("acme", ["b"])]
    await notices.stop()


async def test_waiting_ids_are_bounded():
    notices = ForgetNotices([ForgetTarget("rerank", Target().forget)], max_pending_ids=3)
    notices.notify("acme", ["a", "b"])
    notices.notify("acme", ["c", "d"])  # over the bound: dropped, counted
    assert notices.counts.pending_ids == 2 and notices.counts.given_up == 1


async def test_a_large_notice_goes_in_calls_of_at_most_the_batch():
    rerank = Target()
    notices = ForgetNotices([ForgetTarget("rerank", rerank.forget)])
    ids = [f"d{n}" for n in range(forget_notices.BATCH_IDS + 5)]
    notices.notify("acme", ids)
    notices.start()
    await until(lambda: notices.counts.delivered == 2)
    assert [len(c[1]) for c in rerank.calls] == [forget_notices.BATCH_IDS, 5]
    await notices.stop()


async def test_stop_tries_what_waits_once():
    rerank = Target()
    notices = ForgetNotices([ForgetTarget("rerank", rerank.forget)])
    notices.notify("acme", ["a"])  # never started: stop delivers it
    await notices.stop()
    assert rerank.calls == [("acme", ["a"])]
