"""Telling the services that keep copies derived from documents which ones changed.

Rerank keeps token vectors per document (its token store); generation keeps KV states of
prompts that quoted documents (its prefix store). After a delete or an overwrite is
acknowledged, the ids go to each such service (ForgetDocuments, ForgetSources) so that the
old text leaves them at once. In the background: a write never waits on them, and a
service that is down is tried again with backoff for `retry_for_s`. Not durable: what a
restart of this service, or a failure past `retry_for_s`, loses leaves those stores by
their own expiry instead (docs/security.md, "What is kept, and what a delete reaches").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("ragline.retrieval.forget_notices")

# Most ids in one call (the Forget requests' own bound).
BATCH_IDS = 1000
FIRST_RETRY_S = 0.5
LAST_RETRY_S = 30.0


@dataclass(frozen=True)
class ForgetTarget:
    name: str  # for logs: "rerank", "generation"
    forget: Callable[[str, list[str]], Awaitable[object]]  # (tenant, ids)


@dataclass
class Notice:
    target: ForgetTarget
    tenant: str
    ids: list[str]
    due: float = 0.0  # monotonic: when to (re)try
    first_failed: float | None = None
    attempts: int = 0

    def described(self) -> dict:
        """What a log line says of it."""
        return {
            "target": self.target.name,
            "tenant": self.tenant,
            "ids": len(self.ids),
            "attempts": self.attempts,
        }


@dataclass
class NoticeCounts:
    delivered: int = 0  # notices a target took
    retried: int = 0  # failed attempts tried again later
    given_up: int = 0  # notices dropped after retry_for_s, or over the bound
    pending_ids: int = 0


@dataclass
class ForgetNotices:
    targets: list[ForgetTarget]
    retry_for_s: float = 600.0
    # Ids waiting, over all targets; past it new notices are dropped (and logged): a
    # target down for long must not grow this process without bound.
    max_pending_ids: int = 100_000
    counts: NoticeCounts = field(default_factory=NoticeCounts)
    _pending: list[Notice] = field(default_factory=list)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None
    _in_flight: int = 0

    def notify(self, tenant: str, ids: list[str]) -> None:
        """Queues `ids` of `tenant` (deleted or overwritten) for every target."""
        if not ids:
            return
        for target in self.targets:
            if self.counts.pending_ids + len(ids) > self.max_pending_ids:
                self.counts.given_up += 1
                log.warning(
                    "retrieval.forget_notice_dropped",
                    target=target.name,
                    tenant=tenant,
                    ids=len(ids),
                    why=f"over {self.max_pending_ids} ids waiting",
                )
                continue
            self.counts.pending_ids += len(ids)
            waiting = next(
                (
                    n
                    for n in self._pending
                    if n.target is target
                    and n.tenant == tenant
                    and not n.attempts
                    and len(n.ids) + len(ids) <= BATCH_IDS
                ),
                None,
            )
            if waiting is not None:
                waiting.ids.extend(ids)
                continue
            for start in range(0, len(ids), BATCH_IDS):
                chunk = list(ids[start : start + BATCH_IDS])
                self._pending.append(Notice(target, tenant, chunk, due=time.monotonic()))
        self._wake.set()

    def start(self) -> None:
        if self.targets and self._task is None:
            self._task = asyncio.create_task(self._run(), name="forget-notices")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Tries what is due once more within `grace_s`, then stops."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                for notice in list(self._pending):
                    self._pending.remove(notice)
                    await self._deliver(notice, final=True)

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            notice = min(self._pending, key=lambda n: n.due)
            delay = notice.due - time.monotonic()
            if delay > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            self._pending.remove(notice)
            await self._deliver(notice)

    async def _deliver(self, notice: Notice, *, final: bool = False) -> None:
        self._in_flight += 1
        try:
            await notice.target.forget(notice.tenant, notice.ids)
        except Exception as error:  # a target's failure is retried, never raised
            self._failed(notice, str(error), final)
        else:
            self.counts.delivered += 1
            self.counts.pending_ids -= len(notice.ids)
        finally:
            self._in_flight -= 1

    def _failed(self, notice: Notice, error: str, final: bool) -> None:
        now = time.monotonic()
        notice.first_failed = notice.first_failed or now
        notice.attempts += 1
        if final or now - notice.first_failed >= self.retry_for_s:
            self.counts.given_up += 1
            self.counts.pending_ids -= len(notice.ids)
            log.warning(
                "retrieval.forget_notice_given_up",
                **notice.described(),
                error=error,
                then="the target's own expiry removes what it keeps of them",
            )
            return
        self.counts.retried += 1
        notice.due = now + min(LAST_RETRY_S, FIRST_RETRY_S * 2 ** (notice.attempts - 1))
        self._pending.append(notice)
        log.info("retrieval.forget_notice_retry", **notice.described(), error=error)
