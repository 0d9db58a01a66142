"""The HNSW shard searched in a process of its own, so that vector search runs beside the
service's Python instead of inside its GIL.

qdrant-edge keeps the GIL for the whole of a query (measured on 2 cores: two threads
querying one shard, or two shards, answer fewer queries/s than one thread; two processes
1.8x), so in the service's process every vector search stopped the gRPC handlers, BM25's
Python and the other half of a HYBRID search. Here each shard is owned by one child process
(a shard directory opens in one process only: its WAL is locked) that answers one query at
a time over a socket pair; the service's threads wait on the socket without the GIL. A new
shard gets a new child, started and loaded off the query path while the old one still
answers (loading a 100k-point shard takes ~0.26 s, and the in-process load held the GIL).

The child is a fresh interpreter (`python -m ragline_services.retrieval.shard_process FD
PATH`, never a fork of a process that runs gRPC threads); it exits when the parent's end of
the socket closes, and is restarted when it dies: the query that found it dead is asked
again once, on the restarted child.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import structlog

from ragline.processes import dying_with_this_process

log = structlog.get_logger("ragline.retrieval")


@dataclass(frozen=True)
class ShardQuery:
    """One query of a shard in plain values (what crosses the socket)."""

    vector: np.ndarray  # unit length, float32
    tenant: str
    scopes: tuple[str, ...]
    attribute_terms: tuple[str, ...]
    limit: int
    hnsw_ef: int
    only_pids: tuple[int, ...] | None = None  # exact search among these
    exclude: tuple[int, ...] = ()  # stale copies of documents the delta holds newer


def query_shard(shard, query: ShardQuery) -> list[tuple[int, float]]:
    """(point id, score) of the nearest points the query may see, best first."""
    import qdrant_edge as qe

    must: list[qe.FieldCondition | qe.HasIdCondition] = [
        qe.FieldCondition(key="tenant", match=qe.MatchValue(query.tenant)),
        qe.FieldCondition(key="scope", match=qe.MatchAny(list(query.scopes))),
    ]
    for term in query.attribute_terms:
        must.append(qe.FieldCondition(key="attr", match=qe.MatchValue(term)))
    if query.only_pids is not None:
        must.append(qe.HasIdCondition(set(query.only_pids)))
    must_not = [qe.HasIdCondition(set(query.exclude))] if query.exclude else None
    request = qe.QueryRequest(
        limit=query.limit,
        query=qe.Query.Nearest(query.vector.tolist()),
        filter=qe.Filter(must=list(must), must_not=list(must_not) if must_not else None),
        with_payload=False,
        params=qe.SearchParams(hnsw_ef=query.hnsw_ef, exact=query.only_pids is not None),
    )
    return [(int(p.id), float(p.score)) for p in shard.query(request)]


def _serve(connection: Connection, path: str) -> None:
    """The child: loads the shard, then answers queries one at a time until told to stop
    or the parent is gone."""
    import qdrant_edge as qe

    try:
        shard = qe.EdgeShard.load(path)
    except Exception as error:
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ok", None))
    try:
        while True:
            try:
                verb, payload = connection.recv()
            except EOFError:
                break  # the parent is gone
            if verb == "stop":
                break
            reply: tuple[str, object]
            try:
                reply = ("ok", query_shard(shard, payload))
            except Exception as error:  # sent back: raised where the search asked
                reply = ("error", f"{type(error).__name__}: {error}")
            connection.send(reply)
    finally:
        shard.close()


class ShardProcess:
    """The parent's side of one shard's child: queried and closed like a local shard."""

    def __init__(self, path: str, *, reply_timeout_s: float = 60.0) -> None:
        self.path = path
        self.reply_timeout_s = reply_timeout_s
        self._lock = threading.Lock()  # one request on the socket at a time
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self.restarts = 0
        with self._lock:
            self._start()

    def _running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _start(self) -> None:
        parent, child = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                dying_with_this_process(
                    [
                        sys.executable,
                        "-m",
                        "ragline_services.retrieval.shard_process",
                        str(child.fileno()),
                        self.path,
                    ]
                ),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self._connection = Connection(parent.detach())
        try:
            self._reply(self.reply_timeout_s)  # loaded
        except BaseException:
            self._kill()
            raise

    def _link(self) -> Connection:
        """The pipe to the child; EOFError (a dead child's answer) when there is none."""
        if self._connection is None:
            raise EOFError("no connection to the shard process")
        return self._connection

    def _reply(self, timeout_s: float):
        if not self._link().poll(timeout_s):
            raise TimeoutError(f"the shard process gave no answer in {timeout_s} s")
        status, value = self._link().recv()
        if status == "error":
            raise RuntimeError(f"shard process ({self.path}): {value}")
        return value

    def query(self, query: ShardQuery) -> list[tuple[int, float]]:
        with self._lock:
            for attempt in (1, 2):
                if not self._running():
                    process = self._process
                    if process is None:
                        raise RuntimeError(f"the shard process of {self.path} was closed")
                    self.restarts += 1
                    log.warning(
                        "retrieval.shard_process_restarted",
                        path=self.path,
                        exitcode=process.returncode,
                    )
                    self._kill()
                    self._start()
                try:
                    self._link().send(("query", query))
                    return self._reply(self.reply_timeout_s)
                except (EOFError, OSError, TimeoutError):
                    self._kill()  # dead or stuck: a fresh child answers the retry
                    if attempt == 2:
                        raise
            raise AssertionError("the second attempt returns or raises")

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(5)
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def close(self) -> None:
        with self._lock:
            process = self._process
            if process is not None and process.poll() is None:
                try:
                    self._link().send(("stop", None))
                    process.wait(10)
                except (OSError, EOFError, subprocess.TimeoutExpired):
                    pass
            self._kill()
            self._process = None


class LocalShard:
    """A shard loaded in this process (the GIL is held while it searches)."""

    def __init__(self, path: str) -> None:
        import qdrant_edge as qe

        self.path = path
        self._shard = qe.EdgeShard.load(path)

    def query(self, query: ShardQuery) -> list[tuple[int, float]]:
        return query_shard(self._shard, query)

    def close(self) -> None:
        self._shard.close()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), sys.argv[2])
