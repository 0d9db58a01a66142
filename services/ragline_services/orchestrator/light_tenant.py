"""The light-tenant policy: which tenant's run goes first beside a flood. Its generation is
marked (GenerateRequest.light_tenant) and the generation service runs it in a slot kept for
such requests, pausing the heavier tenants' sequences until it is done
(services/ragline_services/generation/scheduler.py), as fair queueing serves a sparse flow before a
backlogged one. Admission asks this module; no queue or clock of its own here."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ragline_services.orchestrator.run_times import TenantRecord

# How many times another tenant's ask rate makes it the heavier one.
_HEAVIER = 2.0


def is_light(
    tenant: str,
    *,
    running: Mapping[str, int],
    waiting_of: Callable[[str], int],
    tenants: Mapping[str, TenantRecord],
    now: float,
    activity_s: float,
) -> bool:
    """Whether `tenant`, with one run in flight, is a light tenant beside a flood now: no
    other run of its own in flight or waiting and none refused lately, while another
    tenant asks for more than it gets: two or more runs in flight or waiting, a refusal
    within `activity_s` (the front door may hold a flood to one run in flight or none, and
    the next may be admitted while this one generates), or it is active and asks at least
    twice as often. A tenant within its share goes before those beyond theirs. (Ask rates
    alone misjudged a quiet tenant asking back to back: half a flood's rate, now and then
    more.)"""
    if running.get(tenant, 0) != 1 or waiting_of(tenant):
        return False
    me = tenants[tenant]
    if now - me.last_refused < activity_s:
        return False
    mine = me.rate(now)
    for other, known in tenants.items():
        if other == tenant:
            continue
        if running.get(other, 0) + waiting_of(other) >= 2:
            return True
        if now - known.last_refused < activity_s:
            return True
        active = now - known.last_asked < activity_s
        if active and known.rate(now) >= _HEAVIER * mine:
            return True
    return False
