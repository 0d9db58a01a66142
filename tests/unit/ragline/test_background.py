"""Work started from a request that runs as the service's own."""

from __future__ import annotations

import asyncio

from ragline import deadlines, identity
from ragline.background import detached_task


async def test_a_detached_task_has_no_deadline_no_caller_and_outlives_its_starter():
    seen = {}

    async def work():
        await asyncio.sleep(0.05)  # longer than the request that started it
        seen["remaining"] = deadlines.remaining()
        seen["caller"] = identity.optional_caller()
        seen["run_id"] = identity.current_run_id()

    async def request():
        identity.bind(identity.Caller("acme", "ann"), "run-1")
        with deadlines.deadline_scope(0.01):
            return detached_task(work(), name="work")

    task = await asyncio.create_task(request())
    await task
    assert seen == {"remaining": None, "caller": None, "run_id": None}
    # The starter's own context is untouched.
    with deadlines.deadline_scope(5):
        identity.bind(identity.Caller("acme"), "run-2")
        detached_task(asyncio.sleep(0), name="noop")
        assert identity.optional_caller().tenant == "acme" and deadlines.remaining() is not None
