"""The task ledger: atomic, idempotent reservations that can never overspend a task.

Every change is one etcd transaction guarded on the mod revisions of the task record and
of the reservation record, so two workers that both read "1000 left" can never both get
600: the second transaction fails its guard and is decided again on the fresh values the
failed transaction returned (one round trip per attempt). Correctness comes from the guard
alone, across any number of budget-service replicas. Two things only make it faster: a
per-task lock cuts conflicts between workers of this process, and a cache of the records
this process last saw lets a write go out without reading first. A cached view is only
ever used to attempt a write; an answer that is not a committed write (a refusal, a
replay) is always decided on values read fresh from etcd.

Rules a caller can rely on:
- The same reservation id with the same amounts and stage answers like the first call
  (`replayed`); the same id with other amounts is ALREADY_EXISTS and charges nothing. A
  refused reservation stores nothing, so retrying its id is evaluated afresh.
- Settle records actual use (failed calls too) and releases the rest of the reservation;
  actual use above the reservation is accepted only up to what the task has left.
- Cancel moves a reservation to pending: it keeps holding its amounts until its actual use
  is settled. If it is never settled it stays charged until the task's records expire
  (deadline + grace), so the ledger never under-counts.
- Reservations after the task deadline are DEADLINE_EXCEEDED; after CloseTask they are
  FAILED_PRECONDITION; settling and cancelling stay possible until the records expire.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from ragline.budget import Amounts
from ragline.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from ragline_services.budget.records import (
    PENDING,
    RESERVED,
    SETTLED,
    TASK_CLOSED,
    TASK_EXPIRED,
    ReservationRecord,
    TaskRecord,
)
from ragline_services.budget.store import LedgerStore, Versioned

_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_CACHE_ENTRIES = 20_000


@dataclass(frozen=True)
class Outcome:
    task: TaskRecord
    revision: int
    reservation: ReservationRecord | None = None
    replayed: bool = False
    attempts: int = 1


@dataclass(frozen=True)
class Write:
    """A decision to store new versions of the task and reservation records."""

    task: TaskRecord
    reservation: ReservationRecord


@dataclass(frozen=True)
class Unchanged:
    """A decision that needs no write (an idempotent replay)."""


# decide(task, reservation or None, now_ns) -> Write | Unchanged, or raises a refusal.
Decision = Callable[[TaskRecord, ReservationRecord | None, int], Write | Unchanged]


def _check_id(field: str, value: str) -> None:
    if not _ID.match(value):
        raise InvalidArgument(
            field, "must be 1-128 characters of letters, digits, '_', '.', ':', '-'"
        )


# -- decisions: pure functions of the current records ----------------------------------------


def decide_reserve(reservation_id: str, amounts: Amounts, stage: str) -> Decision:
    def decide(task, existing, now_ns):
        if existing is not None:
            if existing.amounts != amounts or existing.stage != stage:
                raise AlreadyExists(
                    f"reservation {reservation_id} of task {task.task_id} was made with other "
                    f"amounts ({existing.amounts.describe()}, stage {existing.stage!r}); "
                    "nothing was charged"
                )
            return Unchanged()
        state = task.state_at(now_ns)
        if state == TASK_EXPIRED:
            late_ms = (now_ns - task.deadline_ns) / 1e6
            raise DeadlineExceeded(
                f"task {task.task_id} passed its deadline {late_ms:.0f} ms ago; no new reservations"
            )
        if state == TASK_CLOSED:
            raise FailedPrecondition(
                f"task {task.task_id} is closed; no new reservations",
                reason="TASK_CLOSED",
                metadata={"task_id": task.task_id},
            )
        if task.max_in_flight and task.in_flight >= task.max_in_flight:
            raise ResourceExhausted(
                f"task {task.task_id} has {task.in_flight} reservations in flight, its cap is "
                f"{task.max_in_flight}; settle one first",
                retry_after_s=0.05,
                reason="TOO_MANY_IN_FLIGHT",
                metadata={"task_id": task.task_id, "max_in_flight": task.max_in_flight},
            )
        if not (task.committed + amounts).fits_within(task.limits):
            over = ", ".join(amounts.exceeding(task.remaining))
            raise ResourceExhausted(
                f"task {task.task_id} budget cannot cover this reservation ({over} too high); "
                f"remaining: {task.remaining.describe()}",
                reason="BUDGET_EXHAUSTED",
                metadata={"task_id": task.task_id, "over": over},
            )
        return Write(
            replace(task, reserved=task.reserved + amounts, in_flight=task.in_flight + 1),
            ReservationRecord(reservation_id, amounts, stage, created_ns=now_ns),
        )

    return decide


def decide_settle(reservation_id: str, actual: Amounts, failed: bool) -> Decision:
    def decide(task, reservation, now_ns):
        if reservation is None:
            raise NotFound(f"reservation {reservation_id} of task {task.task_id} does not exist")
        if reservation.state == SETTLED:
            if reservation.actual != actual or reservation.failed != failed:
                raise AlreadyExists(
                    f"reservation {reservation_id} was already settled with other use "
                    f"({reservation.actual.describe()}, failed={reservation.failed})"
                )
            return Unchanged()
        held = reservation.amounts
        if not actual.fits_within(held + task.remaining):
            raise FailedPrecondition(
                f"actual use ({actual.describe()}) exceeds the reservation ({held.describe()}) "
                f"plus what task {task.task_id} has left ({task.remaining.describe()}); size "
                "calls by their reservation"
            )
        if reservation.state == RESERVED:
            updated = replace(
                task,
                reserved=task.reserved - held,
                used=task.used + actual,
                in_flight=max(task.in_flight - 1, 0),
            )
        else:  # PENDING
            updated = replace(task, pending=task.pending - held, used=task.used + actual)
        settled = replace(
            reservation, state=SETTLED, actual=actual, failed=failed, settled_ns=now_ns
        )
        return Write(updated, settled)

    return decide


def decide_cancel(reservation_id: str, reason: str) -> Decision:
    def decide(task, reservation, now_ns):
        if reservation is None:
            raise NotFound(f"reservation {reservation_id} of task {task.task_id} does not exist")
        if reservation.state != RESERVED:
            return Unchanged()  # already pending or settled: cancelling again changes nothing
        held = reservation.amounts
        updated = replace(
            task,
            reserved=task.reserved - held,
            pending=task.pending + held,
            in_flight=max(task.in_flight - 1, 0),
        )
        return Write(updated, replace(reservation, state=PENDING, cancel_reason=reason))

    return decide


class TaskLedger:
    def __init__(
        self,
        store: LedgerStore,
        *,
        key_prefix: str = "/ragline/budget/v1",
        expiry_grace_s: float = 300.0,
        max_attempts: int = 1000,
        clock_ns=time.time_ns,
    ) -> None:
        self._store = store
        self._prefix = key_prefix.rstrip("/")
        self._grace_s = expiry_grace_s
        self._max_attempts = max_attempts
        self._now_ns = clock_ns
        self._locks: weakref.WeakValueDictionary[bytes, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._seen: OrderedDict[bytes, Versioned | None] = OrderedDict()
        self.conflicts = 0

    def now_ns(self) -> int:
        return self._now_ns()

    # -- keys and the cache of last-seen records --------------------------------------------

    def _task_prefix(self, tenant: str, task_id: str) -> bytes:
        return f"{self._prefix}/{tenant}/{task_id}/".encode()

    def _task_key(self, tenant: str, task_id: str) -> bytes:
        return self._task_prefix(tenant, task_id) + b"task"

    def _reservation_key(self, tenant: str, task_id: str, reservation_id: str) -> bytes:
        return self._task_prefix(tenant, task_id) + f"r/{reservation_id}".encode()

    def _lock(self, key: bytes) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    def _remember(self, key: bytes, value: Versioned | None) -> None:
        self._seen[key] = value
        self._seen.move_to_end(key)
        while len(self._seen) > _CACHE_ENTRIES:
            self._seen.popitem(last=False)

    def _forget_task(self, task_key: bytes) -> None:
        self._seen.pop(task_key, None)

    @staticmethod
    def _task_or_not_found(found: Versioned | None, task_id: str) -> TaskRecord:
        if found is None:
            raise NotFound(
                f"task {task_id} does not exist for this tenant (never opened, or expired "
                "after its deadline + grace)"
            )
        return TaskRecord.loads(found.value)

    # -- the guarded update loop ------------------------------------------------------------

    async def _update(
        self,
        tenant: str,
        task_id: str,
        reservation_id: str,
        decide: Decision,
        *,
        reservation_absent_likely: bool = False,
    ) -> Outcome:
        task_key = self._task_key(tenant, task_id)
        res_key = self._reservation_key(tenant, task_id, reservation_id)
        keys = [task_key, res_key]
        async with self._lock(task_key):
            cached = task_key in self._seen and (res_key in self._seen or reservation_absent_likely)
            if cached:
                snapshot = [self._seen[task_key], self._seen.get(res_key)]
            else:
                snapshot = await self._store.read(keys)
            for attempt in range(1, self._max_attempts + 1):
                task_row, res_row = snapshot
                try:
                    task = self._task_or_not_found(task_row, task_id)
                    reservation = ReservationRecord.loads(res_row.value) if res_row else None
                    decision = decide(task, reservation, self._now_ns())
                except (
                    NotFound,
                    ResourceExhausted,
                    AlreadyExists,
                    FailedPrecondition,
                    DeadlineExceeded,
                ):
                    if not cached:
                        if task_row is None:
                            self._forget_task(task_key)
                        raise
                    # A refusal must rest on fresh values, never on this process's cache.
                    snapshot, cached = await self._store.read(keys), False
                    continue
                if isinstance(decision, Unchanged):
                    if cached:
                        snapshot, cached = await self._store.read(keys), False
                        continue
                    self._remember(task_key, task_row)
                    self._remember(res_key, res_row)
                    return Outcome(
                        task, task_row.mod_revision, reservation, replayed=True, attempts=attempt
                    )
                new_task = decision.task.dumps()
                new_reservation = decision.reservation.dumps()
                revision, fresh = await self._store.write_if_unchanged(
                    {
                        task_key: task_row.mod_revision,
                        res_key: res_row.mod_revision if res_row else 0,
                    },
                    {task_key: new_task, res_key: new_reservation},
                    task.lease_id,
                    reread=keys,
                )
                if revision is not None:
                    self._remember(task_key, Versioned(new_task, revision))
                    self._remember(res_key, Versioned(new_reservation, revision))
                    return Outcome(decision.task, revision, decision.reservation, attempts=attempt)
                self.conflicts += 1
                snapshot, cached = fresh, False
                if attempt >= 2:
                    # Another replica keeps winning: a random pause desynchronises the two
                    # write streams so this one gets through (bounded by the deadline).
                    await asyncio.sleep(random.uniform(0, min(0.0005 * 2**attempt, 0.02)))
        raise Aborted(
            f"task {task_id}: the ledger changed under {self._max_attempts} consecutive "
            "attempts; retry with the same id"
        )

    # -- operations -------------------------------------------------------------------------

    async def reserve(
        self, tenant: str, task_id: str, reservation_id: str, amounts: Amounts, stage: str
    ) -> Outcome:
        _check_id("task_id", task_id)
        _check_id("reservation_id", reservation_id)
        if amounts.is_zero():
            raise InvalidArgument("amounts", "reserve at least one non-zero amount")
        return await self._update(
            tenant,
            task_id,
            reservation_id,
            decide_reserve(reservation_id, amounts, stage),
            reservation_absent_likely=True,
        )

    async def settle(
        self, tenant: str, task_id: str, reservation_id: str, actual: Amounts, failed: bool
    ) -> Outcome:
        _check_id("task_id", task_id)
        _check_id("reservation_id", reservation_id)
        return await self._update(
            tenant, task_id, reservation_id, decide_settle(reservation_id, actual, failed)
        )

    async def cancel(self, tenant: str, task_id: str, reservation_id: str, reason: str) -> Outcome:
        _check_id("task_id", task_id)
        _check_id("reservation_id", reservation_id)
        return await self._update(
            tenant, task_id, reservation_id, decide_cancel(reservation_id, reason)
        )

    async def get(
        self, tenant: str, task_id: str, *, include_reservations: bool = False
    ) -> tuple[TaskRecord, int, list[ReservationRecord]]:
        _check_id("task_id", task_id)
        task_key = self._task_key(tenant, task_id)
        if not include_reservations:
            found = (await self._store.read([task_key]))[0]
            return self._task_or_not_found(found, task_id), found.mod_revision, []
        rows = await self._store.read_prefix(self._task_prefix(tenant, task_id))
        found = next((v for k, v in rows if k == task_key), None)
        task = self._task_or_not_found(found, task_id)
        reservations = sorted(
            (ReservationRecord.loads(v.value) for k, v in rows if k != task_key),
            key=lambda r: (r.created_ns, r.reservation_id),
        )
        return task, found.mod_revision, reservations

    async def open_task(
        self, tenant: str, task_id: str, limits: Amounts, max_in_flight: int, timeout_s: float
    ) -> tuple[TaskRecord, int, bool]:
        _check_id("task_id", task_id)
        if timeout_s <= 0:
            raise InvalidArgument("timeout", "must be positive")
        key = self._task_key(tenant, task_id)
        found = (await self._store.read([key]))[0]
        if found is None:
            now = self._now_ns()
            lease_id = await self._store.grant_lease(max(int(timeout_s + self._grace_s + 0.999), 1))
            task = TaskRecord(
                task_id=task_id,
                tenant=tenant,
                limits=limits,
                max_in_flight=max_in_flight,
                deadline_ns=now + int(timeout_s * 1e9),
                created_ns=now,
                lease_id=lease_id,
            )
            revision, fresh = await self._store.write_if_unchanged(
                {key: 0}, {key: task.dumps()}, lease_id, reread=[key]
            )
            if revision is not None:
                self._remember(key, Versioned(task.dumps(), revision))
                return task, revision, True
            # Another caller opened it first: drop our lease, answer like a replay.
            await self._store.revoke_lease(lease_id)
            found = fresh[0]
        existing = self._task_or_not_found(found, task_id)
        if existing.limits != limits or existing.max_in_flight != max_in_flight:
            raise AlreadyExists(
                f"task {task_id} is already open with other limits "
                f"({existing.limits.describe()}, max_in_flight={existing.max_in_flight}); use a "
                "new task id"
            )
        return existing, found.mod_revision, False

    async def close_task(self, tenant: str, task_id: str) -> tuple[TaskRecord, int]:
        _check_id("task_id", task_id)
        key = self._task_key(tenant, task_id)
        async with self._lock(key):
            found = (await self._store.read([key]))[0]
            for _ in range(self._max_attempts):
                task = self._task_or_not_found(found, task_id)
                if task.state == TASK_CLOSED:
                    return task, found.mod_revision
                closed = replace(task, state=TASK_CLOSED)
                revision, fresh = await self._store.write_if_unchanged(
                    {key: found.mod_revision}, {key: closed.dumps()}, task.lease_id, reread=[key]
                )
                if revision is not None:
                    self._remember(key, Versioned(closed.dumps(), revision))
                    return closed, revision
                self.conflicts += 1
                found = fresh[0]
        raise Aborted(f"task {task_id}: the ledger kept changing while closing; retry")
