"""An in-memory LedgerStore and a settable clock, for the ledger's unit tests (the proof on
a real etcd is tests/integration/services/budget/test_budget.py)."""

from __future__ import annotations

import asyncio

from ragline_services.budget.store import Versioned


class MemoryStore:
    """Revision-guarded key-value store with the LedgerStore interface."""

    def __init__(self) -> None:
        self.data: dict[bytes, Versioned] = {}
        self.revision = 0
        self.lost_writes = 0  # how many next writes to fail as if someone else wrote first

    async def read(self, keys):
        return [self.data.get(key) for key in keys]

    async def read_prefix(self, prefix):
        return sorted((k, v) for k, v in self.data.items() if k.startswith(prefix))

    async def write_if_unchanged(self, expected, puts, lease_id, reread=()):
        await asyncio.sleep(0)
        if self.lost_writes:
            self.lost_writes -= 1
            return None, [self.data.get(key) for key in reread]
        for key, revision in expected.items():
            current = self.data.get(key)
            if (current.mod_revision if current else 0) != revision:
                return None, [self.data.get(key) for key in reread]
        self.revision += 1
        for key, value in puts.items():
            self.data[key] = Versioned(value, self.revision)
        return self.revision, []

    async def grant_lease(self, ttl_s):
        return 7

    async def revoke_lease(self, lease_id):
        pass

    async def ping(self):
        pass


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000_000

    def __call__(self) -> int:
        return self.ns
