"""The task ledger: atomic, idempotent reservations that can never overspend a task.

Every change is one etcd transaction guarded on the task record's mod revision (and on
the reservation record's), so two workers that both read "1000 left" can never both get
600: the second transaction fails its guard, re-reads, and is refused. A per-task lock
inside this process only cuts the conflicts between local workers; correctness comes from
the guard alone, across any number of budget-service replicas.

Rules a caller can rely on:
- The same reservation id with the same amounts (and stage) answers like the first call
  (`replayed`), with the same id and other amounts it is ALREADY_EXISTS and charges nothing.
  A refused reservation stores nothing, so retrying its id is evaluated afresh.
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
from ragline_services.budget.store import LedgerStore

_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass(frozen=True)
class Outcome:
    task: TaskRecord
    revision: int
    reservation: ReservationRecord | None = None
    replayed: bool = False
    attempts: int = 1


def _check_id(field: str, value: str) -> None:
    if not _ID.match(value):
        raise InvalidArgument(
            field, "must be 1-128 characters of letters, digits, '_', '.', ':', '-'"
        )


class TaskLedger:
    def __init__(
        self,
        store: LedgerStore,
        *,
        key_prefix: str = "/ragline/budget/v1",
        expiry_grace_s: float = 300.0,
        max_attempts: int = 64,
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
        self.conflicts = 0

    # -- keys -------------------------------------------------------------------------------

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

    async def _backoff(self, attempt: int) -> None:
        self.conflicts += 1
        await asyncio.sleep(random.uniform(0, min(0.001 * 2**attempt, 0.05)))

    def _conflict_exhausted(self, task_id: str) -> Aborted:
        return Aborted(
            f"task {task_id}: the ledger changed under {self._max_attempts} consecutive "
            "attempts; retry with the same id"
        )

    # -- reads ------------------------------------------------------------------------------

    async def _read(
        self, tenant: str, task_id: str, reservation_id: str | None = None
    ) -> tuple[TaskRecord, int, ReservationRecord | None, int]:
        keys = [self._task_key(tenant, task_id)]
        if reservation_id is not None:
            keys.append(self._reservation_key(tenant, task_id, reservation_id))
        found = await self._store.read(keys)
        if found[0] is None:
            raise NotFound(
                f"task {task_id} does not exist for this tenant (never opened, or expired "
                "after its deadline + grace)"
            )
        task = TaskRecord.loads(found[0].value)
        reservation, reservation_revision = None, 0
        if reservation_id is not None and found[1] is not None:
            reservation = ReservationRecord.loads(found[1].value)
            reservation_revision = found[1].mod_revision
        return task, found[0].mod_revision, reservation, reservation_revision

    async def get(
        self, tenant: str, task_id: str, *, include_reservations: bool = False
    ) -> tuple[TaskRecord, int, list[ReservationRecord]]:
        _check_id("task_id", task_id)
        if not include_reservations:
            task, revision, _, _ = await self._read(tenant, task_id)
            return task, revision, []
        rows = await self._store.read_prefix(self._task_prefix(tenant, task_id))
        task_key = self._task_key(tenant, task_id)
        task_row = next((v for k, v in rows if k == task_key), None)
        if task_row is None:
            raise NotFound(f"task {task_id} does not exist for this tenant")
        reservations = sorted(
            (ReservationRecord.loads(v.value) for k, v in rows if k != task_key),
            key=lambda r: (r.created_ns, r.reservation_id),
        )
        return TaskRecord.loads(task_row.value), task_row.mod_revision, reservations

    def now_ns(self) -> int:
        return self._now_ns()

    # -- open / close -----------------------------------------------------------------------

    async def open_task(
        self, tenant: str, task_id: str, limits: Amounts, max_in_flight: int, timeout_s: float
    ) -> tuple[TaskRecord, int, bool]:
        _check_id("task_id", task_id)
        if timeout_s <= 0:
            raise InvalidArgument("timeout", "must be positive")
        key = self._task_key(tenant, task_id)
        found = (await self._store.read([key]))[0]
        if found is not None:
            return self._same_task(
                TaskRecord.loads(found.value), found.mod_revision, limits, max_in_flight
            )
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
        revision = await self._store.write_if_unchanged({key: 0}, {key: task.dumps()}, lease_id)
        if revision is not None:
            return task, revision, True
        # Another caller opened it first: drop our lease, answer like a replay.
        await self._store.revoke_lease(lease_id)
        found = (await self._store.read([key]))[0]
        if found is None:
            raise Aborted(f"task {task_id} changed while opening; retry")
        return self._same_task(
            TaskRecord.loads(found.value), found.mod_revision, limits, max_in_flight
        )

    @staticmethod
    def _same_task(
        task: TaskRecord, revision: int, limits: Amounts, max_in_flight: int
    ) -> tuple[TaskRecord, int, bool]:
        if task.limits != limits or task.max_in_flight != max_in_flight:
            raise AlreadyExists(
                f"task {task.task_id} is already open with other limits ({task.limits.describe()}, "
                f"max_in_flight={task.max_in_flight}); use a new task id"
            )
        return task, revision, False

    async def close_task(self, tenant: str, task_id: str) -> tuple[TaskRecord, int]:
        _check_id("task_id", task_id)
        key = self._task_key(tenant, task_id)
        for attempt in range(self._max_attempts):
            task, revision, _, _ = await self._read(tenant, task_id)
            if task.state == TASK_CLOSED:
                return task, revision
            closed = replace(task, state=TASK_CLOSED)
            written = await self._store.write_if_unchanged(
                {key: revision}, {key: closed.dumps()}, task.lease_id
            )
            if written is not None:
                return closed, written
            await self._backoff(attempt)
        raise self._conflict_exhausted(task_id)

    # -- reservations -----------------------------------------------------------------------

    async def reserve(
        self, tenant: str, task_id: str, reservation_id: str, amounts: Amounts, stage: str
    ) -> Outcome:
        _check_id("task_id", task_id)
        _check_id("reservation_id", reservation_id)
        if amounts.is_zero():
            raise InvalidArgument("amounts", "reserve at least one non-zero amount")
        task_key = self._task_key(tenant, task_id)
        res_key = self._reservation_key(tenant, task_id, reservation_id)
        async with self._lock(task_key):
            for attempt in range(self._max_attempts):
                task, revision, existing, _ = await self._read(tenant, task_id, reservation_id)
                if existing is not None:
                    if existing.amounts != amounts or existing.stage != stage:
                        raise AlreadyExists(
                            f"reservation {reservation_id} of task {task_id} was made with other "
                            f"amounts ({existing.amounts.describe()}); nothing was charged"
                        )
                    return Outcome(task, revision, existing, replayed=True, attempts=attempt + 1)
                now = self._now_ns()
                self._check_can_reserve(task, now, amounts)
                reservation = ReservationRecord(reservation_id, amounts, stage, created_ns=now)
                updated = replace(
                    task, reserved=task.reserved + amounts, in_flight=task.in_flight + 1
                )
                written = await self._store.write_if_unchanged(
                    {task_key: revision, res_key: 0},
                    {task_key: updated.dumps(), res_key: reservation.dumps()},
                    task.lease_id,
                )
                if written is not None:
                    return Outcome(updated, written, reservation, attempts=attempt + 1)
                await self._backoff(attempt)
        raise self._conflict_exhausted(task_id)

    def _check_can_reserve(self, task: TaskRecord, now_ns: int, amounts: Amounts) -> None:
        state = task.state_at(now_ns)
        if state == TASK_EXPIRED:
            late_ms = (now_ns - task.deadline_ns) / 1e6
            raise DeadlineExceeded(
                f"task {task.task_id} passed its deadline {late_ms:.0f} ms ago; no new reservations"
            )
        if state == TASK_CLOSED:
            raise FailedPrecondition(f"task {task.task_id} is closed; no new reservations")
        if task.max_in_flight and task.in_flight >= task.max_in_flight:
            raise ResourceExhausted(
                f"task {task.task_id} has {task.in_flight} reservations in flight, its cap is "
                f"{task.max_in_flight}; settle one first",
                retry_after_s=0.05,
            )
        if not (task.committed + amounts).fits_within(task.limits):
            over = ", ".join(amounts.exceeding(task.remaining))
            raise ResourceExhausted(
                f"task {task.task_id} budget cannot cover this reservation ({over} too high); "
                f"remaining: {task.remaining.describe()}"
            )

    async def settle(
        self, tenant: str, task_id: str, reservation_id: str, actual: Amounts, failed: bool
    ) -> Outcome:
        _check_id("task_id", task_id)
        _check_id("reservation_id", reservation_id)
        task_key = self._task_key(tenant, task_id)
        res_key = self._reservation_key(tenant, task_id, reservation_id)
        async with self._lock(task_key):
            for attempt in range(self._max_attempts):
                task, revision, reservation, res_revision = await self._read(
                    tenant, task_id, reservation_id
                )
                if reservation is None:
                    raise NotFound(f"reservation {reservation_id} of task {task_id} does not exist")
                if reservation.state == SETTLED:
                    if reservation.actual != actual or reservation.failed != failed:
                        raise AlreadyExists(
                            f"reservation {reservation_id} was already settled with other use "
                            f"({reservation.actual.describe()}, failed={reservation.failed})"
                        )
                    return Outcome(task, revision, reservation, replayed=True, attempts=attempt + 1)
                held = reservation.amounts
                # Use above the reservation must fit into what the task has left.
                if not actual.fits_within(held + task.remaining):
                    raise FailedPrecondition(
                        f"actual use ({actual.describe()}) exceeds the reservation "
                        f"({held.describe()}) plus what task {task_id} has left "
                        f"({task.remaining.describe()}); size calls by their reservation"
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
                    reservation,
                    state=SETTLED,
                    actual=actual,
                    failed=failed,
                    settled_ns=self._now_ns(),
                )
                written = await self._store.write_if_unchanged(
                    {task_key: revision, res_key: res_revision},
                    {task_key: updated.dumps(), res_key: settled.dumps()},
                    task.lease_id,
                )
                if written is not None:
                    return Outcome(updated, written, settled, attempts=attempt + 1)
                await self._backoff(attempt)
        raise self._conflict_exhausted(task_id)

    async def cancel(self, tenant: str, task_id: str, reservation_id: str, reason: str) -> Outcome:
        _check_id("task_id", task_id)
        _check_id("reservation_id", reservation_id)
        task_key = self._task_key(tenant, task_id)
        res_key = self._reservation_key(tenant, task_id, reservation_id)
        async with self._lock(task_key):
            for attempt in range(self._max_attempts):
                task, revision, reservation, res_revision = await self._read(
                    tenant, task_id, reservation_id
                )
                if reservation is None:
                    raise NotFound(f"reservation {reservation_id} of task {task_id} does not exist")
                if reservation.state != RESERVED:
                    # Already pending or settled: cancelling again changes nothing.
                    return Outcome(task, revision, reservation, replayed=True, attempts=attempt + 1)
                held = reservation.amounts
                updated = replace(
                    task,
                    reserved=task.reserved - held,
                    pending=task.pending + held,
                    in_flight=max(task.in_flight - 1, 0),
                )
                pending = replace(reservation, state=PENDING, cancel_reason=reason)
                written = await self._store.write_if_unchanged(
                    {task_key: revision, res_key: res_revision},
                    {task_key: updated.dumps(), res_key: pending.dumps()},
                    task.lease_id,
                )
                if written is not None:
                    return Outcome(updated, written, pending, attempts=attempt + 1)
                await self._backoff(attempt)
        raise self._conflict_exhausted(task_id)
