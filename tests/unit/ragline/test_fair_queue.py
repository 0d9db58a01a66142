"""The per-tenant fair queue the schedulers share: turns, the lightest first, caps."""

from __future__ import annotations

from ragline.fair_queue import FairQueue


def test_tenants_take_turns_and_a_flood_waits_behind_one_of_each():
    queue: FairQueue[str, str] = FairQueue(100)
    for i in range(5):
        queue.push("flood", f"f{i}")
    queue.push("quiet", "q0")
    served = []
    while queue:
        served.append(queue.pop(next(queue.keys())))
    # the quiet tenant's one item goes second, not sixth
    assert served == ["f0", "q0", "f1", "f2", "f3", "f4"]
    assert queue.waiting == 0 and queue.waiting_of("flood") == 0


def test_the_lightest_tenant_goes_first_and_the_round_breaks_ties():
    queue: FairQueue[str, str] = FairQueue(100)
    for tenant in ("a", "b", "c"):
        queue.push(tenant, tenant + "1")
    running = {"a": 2, "b": 1, "c": 1}
    assert queue.lightest(running.__getitem__) == "b"
    queue.pop("b")
    queue.push("b", "b2")  # b is now behind c in the round
    assert queue.lightest(running.__getitem__) == "c"


def test_caps_are_per_tenant_then_for_all_in_the_callers_units():
    queue: FairQueue[tuple[int, str], list[str]] = FairQueue(
        10, 6, size=len, tenant_of=lambda key: key[1]
    )
    queue.push((0, "acme"), ["x"] * 4)
    queue.push((1, "acme"), ["x"] * 2)  # another lane, the same tenant's cap
    assert queue.waiting_of("acme") == 6 and queue.waiting == 6
    assert queue.over_cap("acme", 1) == "tenant"
    assert queue.over_cap("globex", 4) is None
    queue.push((0, "globex"), ["x"] * 4)
    assert queue.over_cap("initech", 1) == "all"
    assert queue.items_of((0, "acme")) == 1


def test_the_default_tenant_cap_is_half_the_queue():
    assert FairQueue(16).max_per_tenant == 8
    assert FairQueue(1).max_per_tenant == 1
    assert FairQueue(0).over_cap("acme") == "all"


def test_a_removed_item_frees_its_units_and_an_absent_one_is_said():
    queue: FairQueue[str, str] = FairQueue(10, size=len)
    queue.push("acme", "abc")
    queue.push("acme", "de")
    assert queue.remove("acme", "abc") and queue.waiting == 2
    assert not queue.remove("acme", "abc") and not queue.remove("globex", "de")
    assert queue.head("acme") == "de"
    assert queue.drain() == ["de"] and not queue and queue.waiting_of("acme") == 0
