"""What the ledger stores in etcd: one task record (limits + totals) and one record per
reservation, both JSON, both attached to the task's lease."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from ragline.budget import Amounts

TASK_OPEN = "open"
TASK_CLOSED = "closed"
TASK_EXPIRED = "expired"  # derived on read: the deadline passed, the lease not yet

RESERVED = "reserved"
PENDING = "pending"
SETTLED = "settled"


@dataclass(frozen=True)
class TaskRecord:
    task_id: str
    tenant: str
    limits: Amounts
    max_in_flight: int
    deadline_ns: int
    created_ns: int
    lease_id: int
    state: str = TASK_OPEN
    reserved: Amounts = field(default_factory=Amounts)
    pending: Amounts = field(default_factory=Amounts)
    used: Amounts = field(default_factory=Amounts)
    in_flight: int = 0

    @property
    def committed(self) -> Amounts:
        """Everything the task has promised or spent: it never exceeds the limits."""
        return self.reserved + self.pending + self.used

    @property
    def remaining(self) -> Amounts:
        return self.limits - self.committed

    def state_at(self, now_ns: int) -> str:
        if self.state == TASK_OPEN and now_ns >= self.deadline_ns:
            return TASK_EXPIRED
        return self.state

    def with_totals(self, **changes) -> TaskRecord:
        return replace(self, **changes)

    def dumps(self) -> bytes:
        return json.dumps(
            {
                "task_id": self.task_id,
                "tenant": self.tenant,
                "limits": self.limits.to_dict(),
                "max_in_flight": self.max_in_flight,
                "deadline_ns": self.deadline_ns,
                "created_ns": self.created_ns,
                "lease_id": self.lease_id,
                "state": self.state,
                "reserved": self.reserved.to_dict(),
                "pending": self.pending.to_dict(),
                "used": self.used.to_dict(),
                "in_flight": self.in_flight,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def loads(cls, raw: bytes) -> TaskRecord:
        data = json.loads(raw)
        return cls(
            task_id=data["task_id"],
            tenant=data["tenant"],
            limits=Amounts.from_dict(data["limits"]),
            max_in_flight=data["max_in_flight"],
            deadline_ns=data["deadline_ns"],
            created_ns=data["created_ns"],
            lease_id=data["lease_id"],
            state=data["state"],
            reserved=Amounts.from_dict(data["reserved"]),
            pending=Amounts.from_dict(data["pending"]),
            used=Amounts.from_dict(data["used"]),
            in_flight=data["in_flight"],
        )


@dataclass(frozen=True)
class ReservationRecord:
    reservation_id: str
    amounts: Amounts
    stage: str
    created_ns: int
    state: str = RESERVED
    actual: Amounts | None = None
    failed: bool = False
    settled_ns: int = 0
    cancel_reason: str = ""

    def dumps(self) -> bytes:
        return json.dumps(
            {
                "reservation_id": self.reservation_id,
                "amounts": self.amounts.to_dict(),
                "stage": self.stage,
                "created_ns": self.created_ns,
                "state": self.state,
                "actual": None if self.actual is None else self.actual.to_dict(),
                "failed": self.failed,
                "settled_ns": self.settled_ns,
                "cancel_reason": self.cancel_reason,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def loads(cls, raw: bytes) -> ReservationRecord:
        data = json.loads(raw)
        return cls(
            reservation_id=data["reservation_id"],
            amounts=Amounts.from_dict(data["amounts"]),
            stage=data["stage"],
            created_ns=data["created_ns"],
            state=data["state"],
            actual=None if data["actual"] is None else Amounts.from_dict(data["actual"]),
            failed=data["failed"],
            settled_ns=data["settled_ns"],
            cancel_reason=data["cancel_reason"],
        )
