"""Admission and slot scheduling for generation (continuous batching across slots).

The engine runs `slots` sequences at once (llama-server decodes all busy slots in one
batch). A request waits in a bounded queue, with its deadline, until a slot is free;
a full queue is refused at once (RESOURCE_EXHAUSTED with a retry hint), so is a request
that would only wait to time out (its expected wait, from how long recent requests held
their slots and what is queued ahead of it, is longer than its deadline leaves:
DEADLINE_TOO_SHORT_FOR_QUEUE), and a request whose deadline passes while queued leaves
with DEADLINE_EXCEEDED. The queue is fair
between tenants: each has its own (at most `max_queue_per_tenant` waiting, less than the
whole queue, so one tenant cannot fill it for everyone), and a freed slot goes to the
waiting tenants in turn, so a tenant's single request waits behind at most one request of
each other tenant, never behind a flood.

Prefix-cache isolation: each slot keeps the KV cache of its last prompt and belongs to the
owner that wrote it: a tenant and the visibility scopes its caller held (the prompt holds
evidence only they may see). A request prefers a free slot its own owner holds (a warm
prefix), then an empty one; a slot another owner holds is erased before it is handed
over. An erase that fails or is cancelled leaves the slot its previous owner's, so the
next other owner erases it again: nobody can hit, or time, a prefix cached for another
tenant, or for a principal of its own tenant who sees more. The queues and their turns
are per tenant.

Light tenants first (`priority_slots`): a request its caller marks as a light tenant's,
or else one of a tenant with nothing running or waiting here while another has two or
more, is a priority request: it takes a free slot (the `priority_slots` kept beside the
others are for it), and no other tenant's sequence starts while it runs. Which running
sequences it pauses, and when they run again: pausing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline.fair_queue import FairQueue
from ragline_services.generation.leases import Lease, Slot
from ragline_services.generation.pausing import LIGHT_ABOUT_S, Pausing

# Leases seen before a wait is estimated (and a request refused on it).
_HOLDS_BEFORE_ESTIMATING = 4


@dataclass
class _Waiter:
    tenant: str
    owner: str
    deadline: float | None
    future: asyncio.Future[Slot] = field(repr=False)
    priority: bool = False


class SlotScheduler:
    def __init__(
        self,
        slots: int,
        max_queue: int,
        erase: Callable[[int], Awaitable[None]],
        *,
        max_queue_per_tenant: int = 0,
        typical_request_s: float = 2.0,
        priority_slots: int = 0,
        yield_step_tokens: int = 0,
        light_about_s: float = LIGHT_ABOUT_S,
    ) -> None:
        # The engine's slots: `priority_slots` for priority requests, then `slots` for anyone.
        # The kept ones come first: llama-server fills each step's batch in slot order, so
        # a light request's prompt goes before what the others still have in that step.
        self.slots = [Slot(i, reserved=True) for i in range(priority_slots)] + [
            Slot(priority_slots + i) for i in range(slots)
        ]
        self.priority_slots = priority_slots
        self._leases: list[Lease] = []
        self.erase = erase
        self._paused = False
        self._idle = asyncio.Event()
        self._idle.set()
        # Waiters by tenant; the round's order is the order of hand-overs.
        self._queue: FairQueue[str, _Waiter] = FairQueue(max_queue, max_queue_per_tenant)
        self._typical_request_s = typical_request_s
        self._holds: deque[float] = deque(maxlen=64)  # seconds recent leases lasted
        # Requests refused at once, by reason (QUEUE_FULL, DEADLINE_TOO_SHORT_FOR_QUEUE),
        # and those whose deadline passed while they waited.
        self.refusals: Counter[str] = Counter()
        self.expired_waiting = 0
        # What a priority request pauses, and when that runs again (pausing.py).
        self.pausing = Pausing(
            lambda: self._leases,
            yield_step_tokens=yield_step_tokens,
            light_about_s=light_about_s,
        )

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    def _refuse(self, waiting: int, limit: int, whose: str) -> ResourceExhausted:
        retry = self._typical_request_s * (waiting + 1) / len(self.slots)
        self.refusals["QUEUE_FULL"] += 1
        return ResourceExhausted(
            f"generation is at capacity for {whose}: {self.busy} sequences running, "
            f"{waiting} waiting (limit {limit}); retry in about {retry:.1f} s",
            retry_after_s=retry,
            reason="QUEUE_FULL",
            metadata={
                "queue": "generation",
                "scope": "tenant" if whose == "this tenant" else "all",
            },
        )

    def expected_wait_s(self, tenant: str) -> float:
        """How long a request of `tenant` queued now would wait for a slot: the requests
        served before it (its tenant's queue, and at most one more than that from each
        other tenant, as turns go round) at the median recent hold, over the slots. 0
        until enough leases were seen to say."""
        if len(self._holds) < _HOLDS_BEFORE_ESTIMATING:
            return 0.0
        mine = self._queue.waiting_of(tenant)
        ahead = mine + sum(
            min(self._queue.items_of(other), mine + 1)
            for other in self._queue.keys()
            if other != tenant
        )
        typical = statistics.median(self._holds)
        return typical * (ahead + 0.5) / len(self.slots)

    def _refuse_if_it_would_only_time_out(self, tenant: str, deadline: float | None) -> None:
        if deadline is None:
            return
        left = deadline - time.monotonic()
        wait = self.expected_wait_s(tenant)
        if wait <= left:
            return
        self.refusals["DEADLINE_TOO_SHORT_FOR_QUEUE"] += 1
        raise ResourceExhausted(
            f"generation cannot start this request in time: it would wait about {wait:.1f} s "
            f"for a slot ({self.busy} running, {self.waiting} waiting), more than the "
            f"{max(left, 0):.1f} s its deadline leaves; retry in about {wait:.1f} s or with a "
            "longer deadline",
            retry_after_s=wait,
            reason="DEADLINE_TOO_SHORT_FOR_QUEUE",
            metadata={"queue": "generation"},
        )

    def _load(self, tenant: str) -> int:
        """What a tenant has in generation: its leases and its waiting requests."""
        held = sum(lease.tenant == tenant for lease in self._leases)
        return held + self._queue.waiting_of(tenant)

    def _is_priority(self, tenant: str, light: bool) -> bool:
        if self.priority_slots == 0:
            return False
        if light:
            return True
        return self._load(tenant) == 0 and any(
            self._load(lease.tenant) >= 2 for lease in self._leases
        )

    def _pick(self, owner: str, tenant: str = "", *, priority: bool = False) -> Slot | None:
        if self._paused or (not priority and self.pausing.held_back(tenant)):
            return None
        free = [s for s in self.slots if not s.busy and (priority or not s.reserved)]
        if priority:
            free = [s for s in free if s.reserved] or free  # first in the engine's steps
        if not free:
            return None
        own = [s for s in free if s.owner == owner]
        if own:
            return max(own, key=lambda s: s.last_used)
        empty = [s for s in free if s.owner is None]
        if empty:
            return empty[0]
        return min(free, key=lambda s: s.last_used)  # least recently used other owner's

    async def acquire(
        self,
        tenant: str,
        deadline: float | None,
        owner: str = "",
        *,
        pausable: bool = False,
        light: bool = False,
    ) -> Lease:
        """A slot for a request of `tenant` (its queue and turn); `owner` (the tenant
        itself by default) decides whose cached prefix it may reuse. `pausable`: the
        holder can pause its sequence when asked (Lease.paused, wait_resumed). `light`:
        the caller marks it a light tenant's request (see the module)."""
        owner = owner or tenant
        started = time.monotonic()
        priority = self._is_priority(tenant, light)
        picked = (
            self._pick(owner, tenant, priority=priority) if priority or not self._queue else None
        )
        if picked is not None:
            slot = picked
        else:
            scope = self._queue.over_cap(tenant)
            if scope == "tenant":
                mine = self._queue.waiting_of(tenant)
                raise self._refuse(mine, self._queue.max_per_tenant, "this tenant")
            if scope == "all":
                raise self._refuse(self.waiting, self._queue.max_total, "all tenants")
            self._refuse_if_it_would_only_time_out(tenant, deadline)
            waiter = _Waiter(
                tenant, owner, deadline, asyncio.get_running_loop().create_future(), priority
            )
            self._queue.push(tenant, waiter)
            try:
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
                slot = await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            except TimeoutError:
                self._abandon(waiter)
                self.expired_waiting += 1
                raise DeadlineExceeded(
                    f"deadline passed after {(time.monotonic() - started) * 1000:.0f} ms "
                    "waiting for a generation slot"
                ) from None
            except asyncio.CancelledError:
                self._abandon(waiter)
                raise
        slot.busy = True
        slot.taken_at = time.monotonic()
        self._idle.clear()
        lease = Lease(
            slot,
            0.0,
            False,
            False,
            tenant=tenant,
            priority=priority,
            pausable=pausable,
            deadline=deadline,
        )
        self._leases.append(lease)
        if priority:
            self.pausing.pause_others(tenant)
        elif self.pausing.held_back(tenant) and pausable:
            self.pausing.hold_arriving(lease)
        warm = slot.owner == owner
        erased = False
        if slot.owner not in (None, owner):
            try:
                await self.erase(slot.index)
            except BaseException:
                # Failed or cancelled part-way: the cache holds the previous owner's prefix
                # or nothing. It stays that owner's, so the next other owner erases again.
                self.release(slot)
                raise
            erased = True
            slot.tokens = ()
        slot.owner = owner
        lease.waited_s, lease.warm, lease.erased = time.monotonic() - started, warm, erased
        return lease

    def _abandon(self, waiter: _Waiter) -> None:
        if self._queue.remove(waiter.tenant, waiter):
            return
        if waiter.future.done() and not waiter.future.cancelled():
            # A slot was handed over just as the waiter gave up: pass it on.
            self.release(waiter.future.result())

    def set_aside(self, lease: Lease) -> None:
        """`lease`'s sequence is over, and its holder keeps the slot a little longer for
        the service's own work on it (saving its prompt's state): as a priority request it
        has ended (paused sequences resume), and nothing pauses it."""
        self.pausing.priority_ends(lease)
        lease.pausable, lease.interrupt = False, None
        lease.resumed.set()
        self.pausing.resume_when_clear()
        self._hand_over()  # what it held back waiting may start in a free slot now

    def release(self, slot: Slot) -> None:
        for lease in self._leases:
            if lease.slot is slot:
                self.pausing.priority_ends(lease)
        self._leases = [lease for lease in self._leases if lease.slot is not slot]
        self.pausing.resume_when_clear()
        slot.busy = False
        slot.last_used = time.monotonic()
        if slot.taken_at:
            self._holds.append(slot.last_used - slot.taken_at)
            slot.taken_at = 0.0
        if not any(s.busy for s in self.slots):
            self._idle.set()
        self._hand_over()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Holds new requests in the queue and waits for running ones to finish (to swap
        the engine underneath); every slot starts empty afterwards."""
        self._paused = True
        try:
            await self._idle.wait()
            yield
            for slot in self.slots:
                slot.owner = None
                slot.tokens = ()
        finally:
            self._paused = False
            self._hand_over()

    def _hand_over(self) -> None:
        handed = True
        while handed and self._queue:
            handed = False
            for tenant in list(self._queue.keys()):
                if self._hand_over_to(tenant):
                    handed = True
                    break

    def _hand_over_to(self, tenant: str) -> bool:
        """Gives the first waiter of `tenant` a slot if one is free for it; whether the
        queues changed."""
        waiter = self._queue.head(tenant)
        slot = None
        if not waiter.future.done():  # else it gave up: just dropped
            slot = self._pick(waiter.owner, tenant, priority=waiter.priority)
            if slot is None:
                return False
        # The tenant goes to the back of the round: the next free slot is another's.
        self._queue.pop(tenant)
        if slot is not None:
            slot.busy = True  # reserved for the waiter; acquire() finishes the hand-over
            self._idle.clear()
            waiter.future.set_result(slot)
        return True
