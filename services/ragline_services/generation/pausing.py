"""Light tenants first: what a light tenant's request pauses, and when that runs again.

A request its caller marks as a light tenant's (the orchestrator does, for a run of a
tenant with no other run in flight while another tenant has several), or else a request
of a tenant that has nothing running or waiting here while another tenant has two or
more, is a priority request. It takes a free slot
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
import statistics
import time
from collections import deque
from collections.abc import Callable

from ragline_services.generation.leases import Lease

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


class Pausing:
    """The pause policy over the scheduler's leases (`leases()`: those held now)."""

    def __init__(
        self,
        leases: Callable[[], list[Lease]],
        *,
        yield_step_tokens: int = 0,
        light_about_s: float = LIGHT_ABOUT_S,
    ) -> None:
        self._leases = leases
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

    def held_back(self, tenant: str) -> bool:
        """Another tenant starts nothing while a priority request runs."""
        return any(lease.priority and lease.tenant != tenant for lease in self._leases())

    def note_decode(self, seconds: float) -> None:
        """How long a finished sequence's decode took (the engine's own figure)."""
        self._decodes.append(seconds)

    def decode_s(self) -> float | None:
        """What a decode takes (its 90th percentile), once enough have been seen."""
        if len(self._decodes) < _DECODES_BEFORE_ESTIMATING:
            return None
        return statistics.quantiles(self._decodes, n=10, method="inclusive")[-1]

    @staticmethod
    def finish_by(lease: Lease, decode: float | None) -> float | None:
        """When a paused `lease` must run again to finish a decode of `decode` seconds by
        its deadline (None: it waits for the priority request, however long)."""
        if not lease.decoding or lease.deadline is None or decode is None:
            return None
        return lease.deadline - decode

    def pause_others(self, light: str) -> None:
        now, decode = time.monotonic(), self.decode_s()
        for lease in self._leases():
            if lease.priority or not lease.pausable or lease.paused or lease.tenant == light:
                continue
            self.was_held_back(lease.tenant)
            finish_by = self.finish_by(lease, decode)
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
            other.priority and not other.decoding for other in self._leases()
        ):
            return
        for other in self._leases():
            if other.paused and other.decoding:
                other.resumed.set()
                self.decoding_beside += 1

    def yielding(self, lease: Lease) -> bool:
        """Whether `lease` reads what is left of its prompt in yielding steps now."""
        if not self.yield_step_tokens or lease.priority or not lease.pausable:
            return False
        return time.monotonic() < self._yields_until.get(lease.tenant, -1.0)

    def was_held_back(self, tenant: str) -> None:
        """A priority request held back a sequence of `tenant` (now, or until it ended)."""
        now = time.monotonic()
        if len(self._yields_until) >= _HELD_BACK_KEPT:
            self._yields_until = {t: u for t, u in self._yields_until.items() if u > now}
        self._yields_until[tenant] = now + self.light_about_s

    def resume_when_clear(self) -> None:
        if any(lease.priority for lease in self._leases()):
            return
        for lease in self._leases():
            lease.resumed.set()

    async def wait_resumed(self, lease: Lease, deadline: float | None) -> bool:
        """Waits while `lease` is paused; False when its deadline passed first. A decoding
        sequence runs again once its deadline is closer than a decode takes."""
        if not lease.paused:
            return True
        finish_by = self.finish_by(lease, self.decode_s())
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

    def priority_ends(self, lease: Lease) -> None:
        if lease.priority:
            for other in self._leases():
                if not other.priority:
                    self.was_held_back(other.tenant)
            lease.priority = False

    def hold_arriving(self, lease: Lease) -> None:
        """`lease` was handed a slot as a priority request began: it waits like those that
        request paused."""
        self.was_held_back(lease.tenant)
        lease.resumed.clear()
        self.pauses += 1
