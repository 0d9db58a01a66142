"""Group commit and turns between replicas, on the in-memory store: the operations of one
task that meet in one process share a guarded write; every answer waits for that write;
a replica that keeps losing claims the task's turn and the others hold their writes."""

from __future__ import annotations

import asyncio

import pytest

from ragline.budget import Amounts
from ragline.errors import ResourceExhausted, Unavailable
from ragline_services.budget.ledger import TaskLedger, TurnClaim, must_wait_for_turn
from support.memory_ledger import Clock, MemoryStore


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    async def write_if_unchanged(self, expected, puts, lease_id, reread=()):
        self.writes += 1
        await asyncio.sleep(0.002)  # a round trip, during which others queue up
        return await super().write_if_unchanged(expected, puts, lease_id, reread)


async def test_concurrent_operations_of_one_task_share_a_transaction():
    store = CountingStore()
    ledger = TaskLedger(store, clock_ns=Clock())
    await ledger.open_task("acme", "t", Amounts(calls=100), 0, 60)
    store.writes = 0
    outcomes = await asyncio.gather(
        *(ledger.reserve("acme", "t", f"r{i}", Amounts(calls=1), "") for i in range(20))
    )
    assert store.writes <= 3  # the first alone, the others batched behind it (not 20)
    assert ledger.commits == store.writes
    final = (await ledger.get("acme", "t"))[0]
    assert final.reserved == Amounts(calls=20) and final.in_flight == 20
    assert sorted(o.reservation.reservation_id for o in outcomes) == sorted(
        f"r{i}" for i in range(20)
    )
    settled = await asyncio.gather(
        *(ledger.settle("acme", "t", f"r{i}", Amounts(calls=1), False) for i in range(20))
    )
    assert all(o.reservation.state == "settled" for o in settled)
    final = (await ledger.get("acme", "t"))[0]
    assert final.used == Amounts(calls=20) and final.reserved == Amounts()


async def test_a_refusal_in_a_batch_rests_on_the_decisions_before_it():
    store = CountingStore()
    ledger = TaskLedger(store, clock_ns=Clock())
    await ledger.open_task("acme", "t", Amounts(calls=5), 0, 60)
    results = await asyncio.gather(
        *(ledger.reserve("acme", "t", f"r{i}", Amounts(calls=1), "") for i in range(8)),
        return_exceptions=True,
    )
    granted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    assert len(granted) == 5 and len(refused) == 3
    assert (await ledger.get("acme", "t"))[0].reserved == Amounts(calls=5)  # never more


async def test_a_conflict_redecides_the_whole_batch_on_fresh_values():
    store = CountingStore()
    ledger, other = TaskLedger(store, clock_ns=Clock()), TaskLedger(store, clock_ns=Clock())
    await ledger.open_task("acme", "t", Amounts(calls=10), 0, 60)
    await ledger.reserve("acme", "t", "warm", Amounts(calls=1), "")  # ledger's cache is warm
    await other.reserve("acme", "t", "elsewhere", Amounts(calls=6), "")  # behind its back
    results = await asyncio.gather(
        *(ledger.reserve("acme", "t", f"r{i}", Amounts(calls=1), "") for i in range(5)),
        return_exceptions=True,
    )
    assert sum(not isinstance(r, Exception) for r in results) == 3  # 10 - 1 - 6
    assert ledger.conflicts >= 1
    assert (await ledger.get("acme", "t"))[0].reserved == Amounts(calls=10)


async def test_a_cancelled_caller_leaves_the_others_their_answers():
    store = CountingStore()
    ledger = TaskLedger(store, clock_ns=Clock())
    await ledger.open_task("acme", "t", Amounts(calls=10), 0, 60)
    first = asyncio.ensure_future(ledger.reserve("acme", "t", "a", Amounts(calls=1), ""))
    await asyncio.sleep(0)  # `first` holds the lock and commits what queues behind it
    others = [
        asyncio.ensure_future(ledger.reserve("acme", "t", f"b{i}", Amounts(calls=1), ""))
        for i in range(3)
    ]
    await asyncio.sleep(0.003)  # `first`'s write is in flight; the others are queued
    first.cancel()
    done = await asyncio.gather(*others)
    assert [o.reservation.reservation_id for o in done] == ["b0", "b1", "b2"]


def test_the_turn_rule():
    ttl = 50_000_000
    assert not must_wait_for_turn(TurnClaim("", 0), "a", 10, ttl)  # nobody holds it
    assert not must_wait_for_turn(TurnClaim("a", 5), "a", 10, ttl)  # mine
    assert must_wait_for_turn(TurnClaim("b", 5), "a", 10, ttl)  # another's, fresh
    assert not must_wait_for_turn(TurnClaim("b", 5), "a", 5 + ttl, ttl)  # another's, stale
    assert TurnClaim.loads(TurnClaim("b", 7).dumps()) == TurnClaim("b", 7)
    assert TurnClaim.loads(None) == TurnClaim("", 0)


async def test_a_replica_that_keeps_losing_claims_the_turn_and_releases_it():
    store, clock = MemoryStore(), Clock()
    loser = TaskLedger(store, clock_ns=clock, replica_id="b", turn_after=3)
    await loser.open_task("acme", "t", Amounts(calls=10), 0, 60)
    store.lost_writes = 3  # three writes in a row lost to another replica
    outcome = await loser.reserve("acme", "t", "r", Amounts(calls=1), "")
    assert loser.turns_claimed == 1 and outcome.reservation.reservation_id == "r"
    turn = next(v for k, v in store.data.items() if k.endswith(b"/turn"))
    assert TurnClaim.loads(turn.value).holder == ""  # released by the write that won
    _, _, reservations = await loser.get("acme", "t", include_reservations=True)
    assert [r.reservation_id for r in reservations] == ["r"]  # the turn key is no reservation


@pytest.mark.parametrize("stale", [False, True])
async def test_another_replica_holds_its_writes_while_a_fresh_claim_stands(stale):
    store, clock = MemoryStore(), Clock()
    holder = TaskLedger(store, clock_ns=clock, replica_id="b")
    waiter = TaskLedger(store, clock_ns=clock, replica_id="a", turn_ttl_s=0.05)
    await holder.open_task("acme", "t", Amounts(calls=10), 0, 60)
    task_key = next(k for k in store.data if k.endswith(b"/task"))
    turn_key = task_key[: -len(b"task")] + b"turn"
    since = clock.ns - (10**9 if stale else 0)
    await store.write_if_unchanged({turn_key: 0}, {turn_key: TurnClaim("b", since).dumps()}, 7)
    reserve = asyncio.ensure_future(waiter.reserve("acme", "t", "w", Amounts(calls=1), ""))
    await asyncio.sleep(0.03)
    if stale:  # a claim past its age is ignored (its holder may be gone) and cleared
        assert reserve.done() and waiter.turn_waits == 0
    else:
        assert not reserve.done() and waiter.turn_waits >= 1
        await holder.reserve("acme", "t", "h", Amounts(calls=1), "")  # its commit releases
    outcome = await asyncio.wait_for(reserve, 1)
    assert outcome.reservation.reservation_id == "w"
    assert TurnClaim.loads(store.data[turn_key].value).holder == ""


class FailingStore(CountingStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def write_if_unchanged(self, expected, puts, lease_id, reread=()):
        if self.down:
            await asyncio.sleep(0.002)
            raise Unavailable("etcd unreachable (test)")
        return await super().write_if_unchanged(expected, puts, lease_id, reread)


async def test_a_store_failure_reaches_every_operation_of_the_batch_and_charges_nothing():
    store = FailingStore()
    ledger = TaskLedger(store, clock_ns=Clock())
    await ledger.open_task("acme", "t", Amounts(calls=10), 0, 60)
    store.down = True
    results = await asyncio.gather(
        *(ledger.reserve("acme", "t", f"r{i}", Amounts(calls=1), "") for i in range(6)),
        return_exceptions=True,
    )
    assert all(isinstance(r, Unavailable) for r in results)
    store.down = False
    assert (await ledger.get("acme", "t"))[0].reserved == Amounts()  # nothing was granted
    retried = await asyncio.gather(
        *(ledger.reserve("acme", "t", f"r{i}", Amounts(calls=1), "") for i in range(6))
    )
    assert len(retried) == 6 and (await ledger.get("acme", "t"))[0].reserved == Amounts(calls=6)


async def test_a_released_turn_costs_no_conflict_on_later_writes():
    """The turn key stays behind, released, after a claim: every replica must keep its
    current version in its cache, or each later write from the cache would fail its guard
    on the turn key once."""
    store, clock = MemoryStore(), Clock()
    holder = TaskLedger(store, clock_ns=clock, replica_id="b")
    other = TaskLedger(store, clock_ns=clock, replica_id="a")
    await holder.open_task("acme", "t", Amounts(calls=10), 0, 60)
    store.lost_writes = 3
    await holder.reserve("acme", "t", "claimed", Amounts(calls=1), "")  # claims, releases
    await other.reserve("acme", "t", "first", Amounts(calls=1), "")  # learns the turn key
    before = (holder.conflicts, other.conflicts)
    for i in range(3):
        await holder.reserve("acme", "t", f"h{i}", Amounts(calls=1), "")
        await holder.settle("acme", "t", f"h{i}", Amounts(calls=1), False)
    for i in range(3):
        await other.reserve("acme", "t", f"o{i}", Amounts(calls=1), "")
    # One conflict each at most: the first write after the other replica's writes. (Without
    # the turn key in the cache: one per write, 3 and 6.)
    assert holder.conflicts <= before[0] + 1 and other.conflicts <= before[1] + 1
