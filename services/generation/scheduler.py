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

Light tenants first (`priority_slots`): a request its caller marks as a light tenant's
(the orchestrator does, for a run of a tenant with no other run in flight while another
tenant has several), or else a request of a tenant that has nothing running or waiting
here while another tenant has two or more, is a priority request. It takes a free slot
(the `priority_slots` kept beside the others are for it), and every running sequence of
the other tenants is paused: its holder stops its engine stream (the slot keeps its KV
cache) and waits, then resumes where it stopped once no priority request runs. Meanwhile
no sequence of theirs starts. On a CPU, where sequences decoding together share the cores,
a tenant asking one question at a time then gets the engine to itself instead of a share
of it beside a flood.

Pausing reorders work; it must not throw away an answer nearly done. A sequence that is
decoding (its holder marks it at its first token) and whose deadline is closer than a
decode takes (the 90th percentile of recent sequences' decode times, once
_DECODES_BEFORE_ESTIMATING have finished) is not paused, and a paused one is resumed when
its deadline comes that close: cut at its deadline, everything it had done for its
admitted run would be lost. It decodes beside the priority request, one token in each of
its steps, which costs that request little (while that request reads its prompt, a step is
up to a whole batch of prompt tokens, so the kept sequence gains little then); a sequence
still reading its prompt stays paused (its prompt would fill the priority request's
steps). For the same reason, once every priority request has its first token out (its
prompt read), the paused sequences that were decoding run again beside it until it ends
or another priority request comes: what a light tenant needs alone is its prompt's steps.

A flood's prompt step under way holds an arriving light request until it ends, and a
closed stream is noticed only after the step under way (its next write), so a paused
prompt ran one more step still. A tenant whose sequences a priority request held back
(paused, or kept running for their deadline) within `light_about_s` of its end, so one
that floods beside a light tenant, reads its prompts in yielding steps instead:
`yield_step_tokens` at a time, one such step over the engine at once (`prompt_turn`),
each its own engine call that ends by itself; paused, it issues no next one. The light
request then waits for at most one small step: prefill is slower in small steps (64
tokens: ~17% on 2 cores, docs/tuning.md), and only the flood pays it.

A holder may keep its slot after its sequence, for the service's own work on the slot's
cache (the generator saves the prompt's hot prefixes after the answer): it sets its lease
aside first, which ends it as a priority request (the sequences it held back run again)
and makes it unpausable; the slot is still its own until released.
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

# Leases seen before a wait is estimated (and a request refused on it).
_HOLDS_BEFORE_ESTIMATING = 4
# Decodes seen before the time one takes is estimated (until then every sequence pauses).
_DECODES_BEFORE_ESTIMATING = 4
# How long after a priority request that held its sequences back a tenant still reads its
# prompts in yielding steps. A light tenant's questions come seconds apart (an agent's
# steps, a person reading an answer): its next one, after a pause, should find the flood's
# prompts in small steps still, not a whole step under way and one more after it. The
# flood pays ~17% on prefill meanwhile; a tenant never held back (one asking alone) never.
LIGHT_ABOUT_S = 30.0
# Tenants remembered as held back before the expired ones are dropped.
_HELD_BACK_KEPT = 1024


@dataclass
class Slot:
    index: int
    owner: str | None = None  # whose prompt the slot's cache holds (tenant + visibility)
    busy: bool = False
    last_used: float = 0.0
    # The prompt tokens the slot's cache starts with (set by the generator; empty when
    # unknown or erased), so a warm slot is not overwritten by a shorter stored prefix.
    tokens: tuple[int, ...] = ()
    taken_at: float = 0.0  # when its current lease began
    reserved: bool = False  # one of the priority slots


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass(eq=False)
class Lease:
    slot: Slot
    waited_s: float
    warm: bool  # the slot already held this owner's cache
    erased: bool  # the slot was taken from another owner and erased first
    tenant: str = ""
    priority: bool = False  # a light tenant's request (see the module)
    # Whether its holder can stop its sequence and resume it later.
    pausable: bool = False
    # `interrupt` (registered by the holder) ends the holder's read of the engine stream at
    # once; `resumed` is clear while its sequence must stay paused.
    interrupt: Callable[[], None] | None = field(default=None, repr=False)
    resumed: asyncio.Event = field(default_factory=_set_event, repr=False)
    deadline: float | None = None
    # Its first token is out (set by the holder): near its deadline it is not paused.
    decoding: bool = False

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()


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
        self.pauses = 0  # sequences paused for a priority request
        # Paused decoding sequences run again beside priority requests that all decode.
        self.decoding_beside = 0
        # Sequences resumed (or left running) beside a priority request: their deadline
        # was closer than a decode takes.
        self.kept_for_deadline = 0
        self._decodes: deque[float] = deque(maxlen=64)  # seconds recent decodes took
        # Yielding prompt steps (see the module): their size (0: off), one at a time.
        self.yield_step_tokens = yield_step_tokens
        self.light_about_s = light_about_s
        self.prompt_turn = asyncio.Lock()
        # Until when each tenant held back by a priority request reads in yielding steps.
        self._yields_until: dict[str, float] = {}
        self.yielding_prompts = 0  # sequences that read (some of) their prompt so

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

    def _held_back(self, tenant: str) -> bool:
        """Another tenant starts nothing while a priority request runs."""
        return any(lease.priority and lease.tenant != tenant for lease in self._leases)

    def note_decode(self, seconds: float) -> None:
        """How long a finished sequence's decode took (the engine's own figure)."""
        self._decodes.append(seconds)

    def _decode_s(self) -> float | None:
        """What a decode takes (its 90th percentile), once enough have been seen."""
        if len(self._decodes) < _DECODES_BEFORE_ESTIMATING:
            return None
        return statistics.quantiles(self._decodes, n=10, method="inclusive")[-1]

    @staticmethod
    def _finish_by(lease: Lease, decode: float | None) -> float | None:
        """When a paused `lease` must run again to finish a decode of `decode` seconds by
        its deadline (None: it waits for the priority request, however long)."""
        if not lease.decoding or lease.deadline is None or decode is None:
            return None
        return lease.deadline - decode

    def _pause_others(self, light: str) -> None:
        now, decode = time.monotonic(), self._decode_s()
        for lease in self._leases:
            if lease.priority or not lease.pausable or lease.paused or lease.tenant == light:
                continue
            self._was_held_back(lease.tenant)
            finish_by = self._finish_by(lease, decode)
            if finish_by is not None and finish_by <= now:
                self.kept_for_deadline += 1
                continue
            lease.resumed.clear()
            self.pauses += 1
            if lease.interrupt is not None:
                lease.interrupt()

    def started_decoding(self, lease: Lease) -> None:
        """`lease`'s first token is out (its holder says so). Once every priority request
        decodes, the paused sequences that were decoding run beside them: a decode step
        costs the priority request little, a step of another prompt would not (those stay
        paused), and a flood's answer half written gains ground instead of running out."""
        lease.decoding = True
        if not lease.priority or any(
            other.priority and not other.decoding for other in self._leases
        ):
            return
        for other in self._leases:
            if other.paused and other.decoding:
                other.resumed.set()
                self.decoding_beside += 1

    def yielding(self, lease: Lease) -> bool:
        """Whether `lease` reads what is left of its prompt in yielding steps now."""
        if not self.yield_step_tokens or lease.priority or not lease.pausable:
            return False
        return time.monotonic() < self._yields_until.get(lease.tenant, -1.0)

    def _was_held_back(self, tenant: str) -> None:
        """A priority request held back a sequence of `tenant` (now, or until it ended)."""
        now = time.monotonic()
        if len(self._yields_until) >= _HELD_BACK_KEPT:
            self._yields_until = {t: u for t, u in self._yields_until.items() if u > now}
        self._yields_until[tenant] = now + self.light_about_s

    def _resume_when_clear(self) -> None:
        if any(lease.priority for lease in self._leases):
            return
        for lease in self._leases:
            lease.resumed.set()

    async def wait_resumed(self, lease: Lease, deadline: float | None) -> bool:
        """Waits while `lease` is paused; False when its deadline passed first. A decoding
        sequence runs again once its deadline is closer than a decode takes."""
        if not lease.paused:
            return True
        finish_by = self._finish_by(lease, self._decode_s())
        until = min((t for t in (deadline, finish_by) if t is not None), default=None)
        timeout = None if until is None else max(until - time.monotonic(), 0)
        try:
            await asyncio.wait_for(lease.resumed.wait(), timeout)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self.kept_for_deadline += 1
            lease.resumed.set()  # not paused again: it runs beside the priority request
            return True
        return True

    def _pick(self, owner: str, tenant: str = "", *, priority: bool = False) -> Slot | None:
        if self._paused or (not priority and self._held_back(tenant)):
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
            self._pause_others(tenant)
        elif self._held_back(tenant) and pausable:
            # Handed a slot as a priority request began: it waits like those it paused.
            self._was_held_back(tenant)
            lease.resumed.clear()
            self.pauses += 1
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

    def _priority_ends(self, lease: Lease) -> None:
        if lease.priority:
            for other in self._leases:
                if not other.priority:
                    self._was_held_back(other.tenant)
            lease.priority = False

    def set_aside(self, lease: Lease) -> None:
        """`lease`'s sequence is over, and its holder keeps the slot a little longer for
        the service's own work on it (saving its prompt's state): as a priority request it
        has ended (paused sequences resume), and nothing pauses it."""
        self._priority_ends(lease)
        lease.pausable, lease.interrupt = False, None
        lease.resumed.set()
        self._resume_when_clear()
        self._hand_over()  # what it held back waiting may start in a free slot now

    def release(self, slot: Slot) -> None:
        for lease in self._leases:
            if lease.slot is slot:
                self._priority_ends(lease)
        self._leases = [lease for lease in self._leases if lease.slot is not slot]
        self._resume_when_clear()
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
