"""What the measuring tools share (tools/bench_e2e.py, tools/calibrate_gate.py, ...): a stack
started for a measurement, a collection ingested into a tenant once, and questions asked of
several stacks in turn."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ragline import deadlines, identity
from ragline.clients import ChannelPool, ServiceClient
from ragline.tls import TlsConfig
from ragline.v1 import orchestrator_pb2, orchestrator_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from ragline_app.ingest import Checkpoint, ingest, prepare_rerank


def start_stack(
    workdir: Path,
    env_overrides: dict[str, str],
    *,
    only: str = "",
    up_args: list[str] | None = None,
) -> tuple[subprocess.Popen, dict[str, str]]:
    """`ragline up --base-port 0 --no-demo` with its data in `workdir` (a rerun reuses the
    index); `only`: a comma-separated subset of services; `up_args`: more of its options.
    Returns the process and the address of each service."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAGLINE_DATA_DIR": str(workdir), "PYTHONUNBUFFERED": "1"}
    env.update(env_overrides)
    log = (workdir / "up.out").open("w")
    command = [sys.executable, "-m", "ragline_app.cli", "up", "--base-port", "0", "--no-demo"]
    if only:
        command += ["--only", only]
    command += up_args or []
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"ragline up exited; see {workdir / 'up.out'}")
        if "ragline up: ready" in (workdir / "up.out").read_text():
            state = json.loads((workdir / "up.json").read_text())["services"]
            return process, {name: s["address"] for name, s in state.items()}
        time.sleep(1)
    process.kill()
    raise SystemExit("the stack did not start in 15 minutes")


async def ensure_ingested(
    data: Path, addresses: dict, workdir: Path, expected: int, tenant: str
) -> float | None:
    """`data` ingested into `tenant` unless the tenant already holds `expected` documents
    (then only rerank's token vectors are prepared again, a restarted rerank has none).
    The seconds the ingest took, None when it was not ingested now."""
    client = ServiceClient(
        retrieval_pb2_grpc.RetrievalServiceStub,
        addresses["retrieval"],
        caller=identity.Caller(tenant),
    )
    with deadlines.deadline_scope(30):
        status = await client.unary("IndexStatus", retrieval_pb2.IndexStatusRequest())
    if status.tenant_documents >= expected:
        if not addresses.get("rerank"):
            return None
        prepared = await prepare_rerank(
            data, rerank_addr=addresses["rerank"], default_tenant=tenant, notice=print
        )
        print(f"rerank prepared {prepared} passages", file=sys.stderr)
        return None
    started = time.monotonic()
    written, _ = await ingest(
        data,
        retrieval_addr=addresses["retrieval"],
        embedding_addr=addresses["embedding"],
        default_tenant=tenant,
        checkpoint=Checkpoint(workdir / "ingest" / f"{tenant}-{data.name}.json"),
        rerank_addr=addresses.get("rerank"),
        notice=print,
    )
    seconds = time.monotonic() - started
    print(f"ingested {written} passages in {seconds:.0f} s", file=sys.stderr)
    return seconds


async def ask_seconds(client: ServiceClient, question: str) -> float:
    """Seconds one Ask takes to its last message, caches bypassed."""
    request = orchestrator_pb2.AskRequest(
        question=question, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
    )
    started = time.monotonic()
    with deadlines.deadline_scope(60):
        async for _ in client.stream("Ask", request):
            pass
    return time.monotonic() - started


async def ask_pairs(
    stacks: dict[str, tuple[str, TlsConfig | None]], questions: list[str], tenant: str
) -> dict[str, list[float]]:
    """Each question asked of every stack (name -> orchestrator address, how to reach it)
    in turn, the first one alternating, so that a slow moment and a question's own time
    (its answer's length) fall on all: seconds per stack, in question order."""
    pools = {name: ChannelPool(tls) for name, (_, tls) in stacks.items()}
    clients = {
        name: ServiceClient(
            orchestrator_pb2_grpc.OrchestratorServiceStub,
            address,
            pool=pools[name],
            caller=identity.Caller(tenant),
        )
        for name, (address, _) in stacks.items()
    }
    times: dict[str, list[float]] = {name: [] for name in clients}
    for number, question in enumerate(questions):
        order = list(clients) if number % 2 == 0 else list(reversed(list(clients)))
        for name in order:
            times[name].append(await ask_seconds(clients[name], question))
    for pool in pools.values():
        await pool.close()
    return times


@contextlib.contextmanager
def bm25_eval_index(passages, tenant: str = "eval") -> Iterator:
    """Every passage in a throwaway BM25 index of the retrieval service's (one tenant), for
    the tools that measure the lexical ranking alone (a Bm25Index)."""
    import tempfile

    import numpy as np

    from ragline_services.retrieval.bm25 import Bm25Index
    from ragline_services.retrieval.documents import StoredDocument

    no_vector = np.zeros(0, dtype=np.float32)  # BM25 reads title and text only
    with tempfile.TemporaryDirectory(prefix="eval-bm25-") as tmp:
        index = Bm25Index(Path(tmp))
        docs = [
            StoredDocument(tenant, p.id, p.title, p.text, (), {}, no_vector, 1) for p in passages
        ]
        try:
            for start in range(0, len(docs), 500):
                index.apply(docs[start : start + 500], [])
            yield index
        finally:
            index.close()


def bm25_rankings(index, questions, k: int, tenant: str = "eval") -> tuple[dict, list[float]]:
    """The ranking metrics of `questions` against `index` as it is set now (top `k`), and
    each search's time in seconds."""
    from ragline_app.evaluation import ranking_metrics
    from ragline_services.retrieval.documents import Visibility, doc_key, point_id

    # Hits are point ids (the key map resolves only the ones a search returns).
    relevant = [point_id(doc_key(tenant, q.passage_id)) for q in questions]
    rankings, times = [], []
    for q in questions:
        started = time.perf_counter()
        hits = index.search(q.text, Visibility(tenant), k)
        times.append(time.perf_counter() - started)
        rankings.append([h.pid for h in hits])
    return ranking_metrics(rankings, relevant), times
