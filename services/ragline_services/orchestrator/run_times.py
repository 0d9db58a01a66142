"""How long runs take, everyone's and each tenant's: what admission decides by (the
expected run, the slow case, whether a tenant's runs mostly run out of time). No gRPC, no
queue: admission says whether other tenants are active, which splits a tenant's runs into
those that ran beside others and those that ran alone."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Recent runs whose durations set the expected and the slow run time.
_WINDOW = 64
# A tenant's recent runs, and how many make its own estimate (fewer: everyone's).
_TENANT_WINDOW = 16
_TENANT_SAMPLES = 4
# The half-life of a tenant's ask rate (asks refused included).
_RATE_HALF_LIFE_S = 10.0
# Tenants remembered (when they last asked, their run times) before idle ones are forgotten.
TENANTS_KEPT = 4096
_FORGET_AFTER_S = 600.0


@dataclass
class Run:
    held_s: float
    ran_out: bool
    # Another tenant was active as it began or ended: a tenant's runs take longer beside
    # others (its generations pause for light ones, the cores are shared).
    beside: bool = False

    @property
    def needed_s(self) -> float:
        """What the run needed: its time, or more than any deadline where it ran out."""
        return math.inf if self.ran_out else self.held_s


@dataclass
class TenantRecord:
    """What admission remembers of a tenant: when it last asked, its asks (admitted or
    refused) each counted less as it ages (halved every _RATE_HALF_LIFE_S), its recent
    runs, and when it was last refused."""

    last_asked: float
    asks: float = 0.0
    runs: deque[Run] = field(default_factory=lambda: deque(maxlen=_TENANT_WINDOW))
    last_refused: float = -math.inf  # when the front door last refused it

    def rate(self, now: float) -> float:
        """Proportional to its recent ask rate."""
        return self.asks * 0.5 ** ((now - self.last_asked) / _RATE_HALF_LIFE_S)

    def asked(self, now: float) -> None:
        self.asks = self.rate(now) + 1.0
        self.last_asked = now


class RunTimes:
    """Recent run times; `beside_others(tenant)`: whether other tenants are active now."""

    def __init__(self, typical_run_s: float, beside_others: Callable[[str], bool]) -> None:
        self._everyone: deque[float] = deque([typical_run_s], maxlen=_WINDOW)
        self.tenants: dict[str, TenantRecord] = {}
        self._beside_others = beside_others

    def asked(self, tenant: str, now: float) -> TenantRecord:
        known = self.tenants.setdefault(tenant, TenantRecord(now))
        known.asked(now)
        return known

    def ended(self, known: TenantRecord, held_s: float, ran_out: bool, beside: bool) -> None:
        self._everyone.append(held_s)
        known.runs.append(Run(held_s, ran_out, beside))

    def forget_idle(self, now: float, busy: Callable[[], set[str]]) -> None:
        """Forgets tenants idle for long (none of `busy`'s), once many are remembered."""
        if len(self.tenants) <= TENANTS_KEPT:
            return
        kept = busy()
        for tenant, known in list(self.tenants.items()):
            if tenant not in kept and now - known.last_asked > _FORGET_AFTER_S:
                del self.tenants[tenant]

    def own(self, tenant: str | None) -> Sequence[Run] | None:
        """`tenant`'s recent runs when there are enough to go by: those that ran as it
        would now (beside other active tenants, or alone) where there are enough."""
        known = None if tenant is None else self.tenants.get(tenant)
        if tenant is None or known is None or len(known.runs) < _TENANT_SAMPLES:
            return None
        beside = self._beside_others(tenant)
        alike = [run for run in known.runs if run.beside == beside]
        return alike if len(alike) >= _TENANT_SAMPLES else known.runs

    def measured_alone_only(self, tenant: str) -> bool:
        """Whether other tenants are active now while `tenant`'s runs were measured alone
        (fewer than enough of them beside others): its figures say too little."""
        known = self.tenants.get(tenant)
        if known is None or not known.runs or not self._beside_others(tenant):
            return False
        return sum(run.beside for run in known.runs) < _TENANT_SAMPLES

    def _held_s(self, tenant: str | None) -> Sequence[float]:
        """Recent run times: `tenant`'s own where there are enough, else everyone's."""
        own = self.own(tenant)
        return self._everyone if own is None else [r.held_s for r in own]

    def typical_s(self, tenant: str | None = None) -> float:
        """The median of recent run times (`tenant`'s own where there are enough)."""
        return float(np.median(self._held_s(tenant)))

    def mean_s(self, tenant: str | None = None) -> float:
        """The mean of recent run times (`tenant`'s own where there are enough): k runs
        ahead take about k of it in all (the median undercounts when quick abstentions sit
        beside slow answers)."""
        return float(np.mean(self._held_s(tenant)))

    def slow_s(self, tenant: str | None = None) -> float:
        """The 90th percentile of recent run times, `tenant`'s own where there are enough
        (infinite when more than a tenth of them ran out of time): what a run admitted now
        must be ready to take."""
        own = self.own(tenant)
        if own is None:
            return float(np.percentile(self._everyone, 90))
        return float(np.percentile([r.needed_s for r in own], 90, method="higher"))

    def ran_out_mostly(self, tenant: str) -> bool:
        """Whether most of `tenant`'s recent runs ran out of time."""
        own = self.own(tenant)
        return own is not None and 2 * sum(r.ran_out for r in own) > len(own)
