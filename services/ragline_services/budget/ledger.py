"""The task ledger: atomic, idempotent reservations that can never overspend a task.

Every change is one etcd transaction guarded on the mod revisions of the task record and
of the reservation record, so two workers that both read "1000 left" can never both get
600: the second transaction fails its guard and is decided again on the fresh values the
failed transaction returned (one round trip per attempt). Correctness comes from the guard
alone, across any number of budget-service replicas. Three things only make it faster:
- group commit: the reserves, settles and cancels of one task that arrive at this process
  while its previous transaction is in flight are decided one after another on the same
  records and written together in one guarded transaction (at most `MAX_BATCH`); each
  decision sees the ones before it, and every answer waits for the commit (a refusal that
  rests on an earlier decision of the batch holds only once that decision is written);
- a cache of the records this process last saw lets a write go out without reading first.
  A cached view is only ever used to attempt a write; an answer that is not a committed
  write (a refusal, a replay) is always decided on values read fresh from etcd;
- turns between replicas: a replica whose transactions on a task conflicted `turn_after`
  times in a row claims the task's turn key; the others, seeing a fresh claim by another
  replica, hold their writes until the claimant's next commit releases it (or the claim
  is `turn_ttl_s` old), so no replica starves while another keeps winning.

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

Why one file of this length: the pure decisions and the one guarded update loop that
applies them are read together to see that no interleaving can overspend a task.
"""

from __future__ import annotations

import asyncio
import os
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
# Operations per transaction: etcd refuses more than 128 operations in one (its default
# --max-txn-ops); a batch writes each reservation plus the task and the turn key.
MAX_BATCH = 60
_REFUSALS = (NotFound, ResourceExhausted, AlreadyExists, FailedPrecondition, DeadlineExceeded)


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


@dataclass(frozen=True)
class _Answer:
    """What one operation of a batch gets: a refusal, or the records it leaves (`replayed`:
    an idempotent replay that wrote nothing)."""

    refusal: Exception | None = None
    task: TaskRecord | None = None
    reservation: ReservationRecord | None = None
    replayed: bool = False


@dataclass(eq=False)
class _Pending:
    """One operation waiting for the task's next group commit."""

    res_key: bytes
    decide: Decision
    absent_likely: bool
    future: asyncio.Future


@dataclass(frozen=True)
class TurnClaim:
    """Who holds a task's turn, since when (a replica's id; empty: nobody)."""

    holder: str
    since_ns: int

    def dumps(self) -> bytes:
        return f"{self.holder}|{self.since_ns}".encode()

    @classmethod
    def loads(cls, raw: bytes | None) -> TurnClaim:
        holder, _, since = (raw or b"|0").decode().partition("|")
        return cls(holder, int(since or 0))


def _answer(batch: list[_Pending], answers: list[_Answer], revision: int, attempts: int) -> None:
    """Each operation of a committed (or read-only) batch gets its answer or its refusal."""
    for pending, answer in zip(batch, answers, strict=True):
        if answer.refusal is not None:
            pending.future.set_exception(answer.refusal)
        else:
            assert answer.task is not None
            pending.future.set_result(
                Outcome(
                    answer.task,
                    revision,
                    answer.reservation,
                    replayed=answer.replayed,
                    attempts=attempts,
                )
            )


def _revision(row: Versioned | None) -> int:
    """A row's mod revision as a write guard expects it (0: the key must be absent)."""
    return row.mod_revision if row else 0


def must_wait_for_turn(claim: TurnClaim, me: str, now_ns: int, ttl_ns: int) -> bool:
    """Whether `me` must hold its writes: another replica claimed the turn recently."""
    return bool(claim.holder) and claim.holder != me and now_ns - claim.since_ns < ttl_ns


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


def _decide_batch(
    batch: list[_Pending],
    task: TaskRecord,
    records: dict[bytes, ReservationRecord | None],
    now_ns: int,
) -> tuple[TaskRecord, list[_Answer], dict[bytes, ReservationRecord]]:
    """Each operation of a batch decided in order, each on the records the ones before it
    left: the task as it ends, an answer per operation, and the reservations to write
    (`records` is updated with them)."""
    answers: list[_Answer] = []
    changed: dict[bytes, ReservationRecord] = {}
    for pending in batch:
        try:
            decision = pending.decide(task, records[pending.res_key], now_ns)
        except _REFUSALS as error:
            answers.append(_Answer(refusal=error))
            continue
        if isinstance(decision, Unchanged):
            answers.append(_Answer(task=task, reservation=records[pending.res_key], replayed=True))
            continue
        task = decision.task
        records[pending.res_key] = changed[pending.res_key] = decision.reservation
        answers.append(_Answer(task=task, reservation=decision.reservation))
    return task, answers, changed


class TaskLedger:
    def __init__(
        self,
        store: LedgerStore,
        *,
        key_prefix: str = "/ragline/budget/v1",
        expiry_grace_s: float = 300.0,
        max_attempts: int = 1000,
        clock_ns=time.time_ns,
        replica_id: str = "",
        turn_after: int = 3,
        turn_ttl_s: float = 0.05,
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
        self._waiting: dict[bytes, list[_Pending]] = {}  # task key -> next batch
        self.replica_id = replica_id or f"{os.getpid()}-{random.getrandbits(32):08x}"
        self._turn_after = turn_after
        self._turn_ttl_ns = int(turn_ttl_s * 1e9)
        self.conflicts = 0
        self.commits = 0  # transactions written by group commits
        self.turns_claimed = 0
        self.turn_waits = 0

    def now_ns(self) -> int:
        return self._now_ns()

    # -- keys and the cache of last-seen records --------------------------------------------

    def _task_prefix(self, tenant: str, task_id: str) -> bytes:
        return f"{self._prefix}/{tenant}/{task_id}/".encode()

    def _task_key(self, tenant: str, task_id: str) -> bytes:
        return self._task_prefix(tenant, task_id) + b"task"

    def _turn_key(self, task_key: bytes) -> bytes:
        return task_key[: -len(b"task")] + b"turn"

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

    def _task_or_not_found(self, found: Versioned | None, task_id: str) -> tuple[TaskRecord, int]:
        """The task as stored and the revision it was stored at; NOT_FOUND without one."""
        if found is None:
            raise self._not_found(task_id)
        return TaskRecord.loads(found.value), found.mod_revision

    # -- the guarded update loop, one group commit at a time per task ---------------------

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
        pending = _Pending(
            self._reservation_key(tenant, task_id, reservation_id),
            decide,
            reservation_absent_likely,
            asyncio.get_running_loop().create_future(),
        )
        waiting = self._waiting.setdefault(task_key, [])
        waiting.append(pending)
        try:
            async with self._lock(task_key):
                # Whoever holds the lock commits everything queued so far, this one's too.
                while not pending.future.done():
                    batch = waiting[:MAX_BATCH]
                    del waiting[: len(batch)]
                    # Shielded: the others of the batch must get their answer even if this
                    # caller goes away (its own write may still land, as with any call).
                    await asyncio.shield(
                        asyncio.ensure_future(self._commit(task_id, task_key, batch))
                    )
        except asyncio.CancelledError:
            if pending in waiting:
                waiting.remove(pending)  # never taken into a batch: nothing written
            raise
        finally:
            if not waiting and self._waiting.get(task_key) is waiting:
                del self._waiting[task_key]
        return pending.future.result()

    async def _commit(self, task_id: str, task_key: bytes, batch: list[_Pending]) -> None:
        try:
            await self._commit_batch(task_id, task_key, batch)
        except BaseException as error:  # no task, no write in time, or the store failed:
            # every unanswered operation of the batch gets the same answer
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            if not isinstance(error, Exception):
                raise

    async def _commit_batch(self, task_id: str, task_key: bytes, batch: list[_Pending]) -> None:
        turn_key = self._turn_key(task_key)
        res_keys = list(dict.fromkeys(p.res_key for p in batch))
        keys = [task_key, turn_key, *res_keys]
        cached = task_key in self._seen and all(
            p.res_key in self._seen or p.absent_likely for p in batch
        )
        rows = [self._seen.get(k) for k in keys] if cached else await self._store.read(keys)
        losses = 0  # conflicts in a row
        for attempt in range(1, self._max_attempts + 1):
            current = dict(zip(keys, rows, strict=True))
            task_row = current[task_key]
            if task_row is None:
                if cached:
                    rows, cached = await self._store.read(keys), False
                    continue
                self._forget_task(task_key)
                raise self._not_found(task_id)
            turn_row = current[turn_key]
            claim = TurnClaim.loads(turn_row.value if turn_row else None)
            now = self._now_ns()
            if must_wait_for_turn(claim, self.replica_id, now, self._turn_ttl_ns):
                # Another replica kept losing to us and claimed the turn: let it write.
                self.turn_waits += 1
                await asyncio.sleep(min(self._turn_ttl_ns / 1e9 / 10, 0.005))
                rows, cached = await self._store.read(keys), False
                continue
            task = TaskRecord.loads(task_row.value)
            records = {
                k: ReservationRecord.loads(row.value) if (row := current[k]) else None
                for k in res_keys
            }
            task, answers, changed = _decide_batch(batch, task, records, now)
            if cached and any(a.refusal is not None or a.replayed for a in answers):
                # A refusal or a replay must rest on fresh values, never on this cache.
                rows, cached = await self._store.read(keys), False
                continue
            revision = task_row.mod_revision
            if changed:
                puts = {task_key: task.dumps(), **{k: r.dumps() for k, r in changed.items()}}
                if claim.holder:
                    puts[turn_key] = TurnClaim("", 0).dumps()  # release ours, or a stale one
                # Guarded on the turn key too: a claim by another replica fails this write.
                expected = {k: _revision(current[k]) for k in (*puts, turn_key)}
                written, fresh = await self._store.write_if_unchanged(
                    expected, puts, task.lease_id, reread=keys
                )
                if written is None:
                    self.conflicts += 1
                    losses += 1
                    rows, cached = fresh, False
                    if losses >= self._turn_after:
                        rows = await self._claim_turn(keys, rows, task.lease_id)
                        losses = 0
                    elif attempt >= 2:
                        await asyncio.sleep(random.uniform(0, min(0.0002 * 2**attempt, 0.005)))
                    continue
                revision = written
                self.commits += 1
                for key, value in puts.items():
                    self._remember(key, Versioned(value, written))
            # What this commit did not write is cached as read, the turn key included: a
            # cache without it would fail the guard of every later write once.
            for key in keys:
                if not changed or key not in puts:
                    self._remember(key, current[key])
            _answer(batch, answers, revision, attempt)
            return
        raise Aborted(
            f"task {task_id}: the ledger changed under {self._max_attempts} consecutive "
            "attempts; retry with the same id"
        )

    async def _claim_turn(self, keys: list[bytes], rows: list, lease_id: int) -> list:
        """Claims the task's turn (a write of the turn key alone, which conflicts with no
        task write but fails every other replica's next one); returns the rows to decide
        on next."""
        turn_key, turn_row = keys[1], rows[1]
        claim = TurnClaim.loads(turn_row.value if turn_row else None)
        if must_wait_for_turn(claim, self.replica_id, self._now_ns(), self._turn_ttl_ns):
            return rows  # another replica holds it: the loop waits for its release
        mine = TurnClaim(self.replica_id, self._now_ns()).dumps()
        written, fresh = await self._store.write_if_unchanged(
            {turn_key: _revision(turn_row)},
            {turn_key: mine},
            lease_id,
            reread=keys,
        )
        if written is None:
            return fresh
        self.turns_claimed += 1
        return [rows[0], Versioned(mine, written), *rows[2:]]

    @staticmethod
    def _not_found(task_id: str) -> NotFound:
        return NotFound(
            f"task {task_id} does not exist for this tenant (never opened, or expired "
            "after its deadline + grace)"
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
            task, revision = self._task_or_not_found(found, task_id)
            return task, revision, []
        prefix = self._task_prefix(tenant, task_id)
        rows = await self._store.read_prefix(prefix)
        found = next((v for k, v in rows if k == task_key), None)
        task, revision = self._task_or_not_found(found, task_id)
        reservations = sorted(
            (ReservationRecord.loads(v.value) for k, v in rows if k.startswith(prefix + b"r/")),
            key=lambda r: (r.created_ns, r.reservation_id),
        )
        return task, revision, reservations

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
        existing, revision = self._task_or_not_found(found, task_id)
        if existing.limits != limits or existing.max_in_flight != max_in_flight:
            raise AlreadyExists(
                f"task {task_id} is already open with other limits "
                f"({existing.limits.describe()}, max_in_flight={existing.max_in_flight}); use a "
                "new task id"
            )
        return existing, revision, False

    async def close_task(self, tenant: str, task_id: str) -> tuple[TaskRecord, int]:
        _check_id("task_id", task_id)
        key = self._task_key(tenant, task_id)
        async with self._lock(key):
            found = (await self._store.read([key]))[0]
            for _ in range(self._max_attempts):
                task, stored_at = self._task_or_not_found(found, task_id)
                if task.state == TASK_CLOSED:
                    return task, stored_at
                closed = replace(task, state=TASK_CLOSED)
                revision, fresh = await self._store.write_if_unchanged(
                    {key: stored_at}, {key: closed.dumps()}, task.lease_id, reread=[key]
                )
                if revision is not None:
                    self._remember(key, Versioned(closed.dumps(), revision))
                    return closed, revision
                self.conflicts += 1
                found = fresh[0]
        raise Aborted(f"task {task_id}: the ledger kept changing while closing; retry")
