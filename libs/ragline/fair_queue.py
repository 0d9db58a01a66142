"""The per-tenant fair queue the schedulers share (embedding and rerank batching, the
orchestrator's admission, the generation slots): waiting items by tenant, tenants taking
turns, the lightest tenant first where the caller says what "light" is, and caps on what
one tenant and all of them may have waiting.

Pure bookkeeping: no futures, no clocks. The caller decides what an item is, when it is
handed over, and what a refusal says (each queue words its own for its callers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Literal, TypeVar

Item = TypeVar("Item")
Key = TypeVar("Key", bound=Hashable)

Scope = Literal["tenant", "all"]


class FairQueue(Generic[Key, Item]):
    """Items waiting under keys (a tenant, or a lane and a tenant), served in turns: the
    key whose item is taken goes to the back of the round.

    `size` counts an item in the units the caps are in (1: items; a batch's texts);
    `tenant_of` names a key's tenant, whose cap spans all its keys."""

    def __init__(
        self,
        max_total: int,
        max_per_tenant: int = 0,
        *,
        size: Callable[[Item], int] = lambda _: 1,
        tenant_of: Callable[[Key], str] = str,
    ) -> None:
        self.max_total = max_total
        # Half the queue by default: one tenant never fills it alone.
        self.max_per_tenant = max_per_tenant or max((max_total + 1) // 2, 1)
        self._size = size
        self._tenant_of = tenant_of
        # The dict's order is the round's order.
        self._queues: dict[Key, deque[Item]] = {}
        self._by_tenant: dict[str, int] = {}
        self._total = 0

    def __bool__(self) -> bool:
        return bool(self._queues)

    @property
    def waiting(self) -> int:
        """Units waiting, all tenants."""
        return self._total

    def waiting_of(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def items_of(self, key: Key) -> int:
        """Items waiting under `key` (whatever their size)."""
        return len(self._queues.get(key, ()))

    def keys(self) -> Iterator[Key]:
        """Keys with work, in the round's order."""
        return iter(self._queues)

    def over_cap(self, tenant: str, units: int = 1) -> Scope | None:
        """Which cap `units` more of `tenant`'s would pass: its own, then everyone's."""
        if self.waiting_of(tenant) + units > self.max_per_tenant:
            return "tenant"
        if self._total + units > self.max_total:
            return "all"
        return None

    def push(self, key: Key, item: Item) -> None:
        self._queues.setdefault(key, deque()).append(item)
        self._count(key, self._size(item))

    def head(self, key: Key) -> Item:
        return self._queues[key][0]

    def pop(self, key: Key) -> Item:
        """`key`'s oldest item; `key` goes to the back of the round."""
        queue = self._queues.pop(key)
        item = queue.popleft()
        if queue:
            self._queues[key] = queue
        self._count(key, -self._size(item))
        return item

    def lightest(self, load: Callable[[Key], float]) -> Key:
        """The key with work whose `load` is least; the round's order breaks ties."""
        return min(self._queues, key=load)

    def remove(self, key: Key, item: Item) -> bool:
        """Takes `item` out wherever it waits (a caller gave up); whether it was there."""
        queue = self._queues.get(key)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._queues[key]
        self._count(key, -self._size(item))
        return True

    def drain(self) -> list[Item]:
        """Every waiting item (the queue is left empty), for a shutdown to answer."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        self._by_tenant.clear()
        self._total = 0
        return items

    def _count(self, key: Key, units: int) -> None:
        tenant = self._tenant_of(key)
        left = self._by_tenant.get(tenant, 0) + units
        if left:
            self._by_tenant[tenant] = left
        else:
            del self._by_tenant[tenant]
        self._total += units
