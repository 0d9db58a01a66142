"""A generation slot and the lease its holder has on it: the values the scheduler
(scheduler.py) hands out and the pause policy (pausing.py) acts on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field


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
