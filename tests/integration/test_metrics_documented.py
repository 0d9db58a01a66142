"""docs/operations.md is the contract of every metric: after real traffic through the whole
stack (an ingested corpus, a COMPLETE answer, a refused one), each service's /metrics serves
every metric its section documents, and nothing named ragline_* or grpc_server_* that no
section documents."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from ragline.processes import free_ports
from support.metrics import scrape
from support.orchestrator import ask_result

pytestmark = pytest.mark.integration

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
OURS = re.compile(r"^(ragline_|grpc_server_)")


def documented() -> dict[str, set[str]]:
    """service -> the metric families its sections document (a section says which services
    serve it on a line `Served by: `a`, `b`.`)."""
    by_service: dict[str, set[str]] = {}
    for section in re.split(r"^## ", OPERATIONS.read_text(), flags=re.M)[1:]:
        served = re.search(r"^Served by: (.+)$", section, flags=re.M)
        names = re.findall(r"^\| `([a-z_:]+)` \|", section, flags=re.M)
        if not names:
            continue
        assert served, f"section {section.splitlines()[0]!r} names metrics but no services"
        for service in re.findall(r"`([a-z]+)`", served.group(1)):
            # the exposition's family names: a counter's without its _total
            by_service.setdefault(service, set()).update(n.removesuffix("_total") for n in names)
    return by_service


def test_documentation_parses_into_every_service():
    assert set(documented()) == {
        "budget",
        "embedding",
        "retrieval",
        "rerank",
        "generation",
        "orchestrator",
        "gateway",
    }


async def test_every_documented_metric_is_served_and_every_served_one_documented(rag_stack):
    orchestrator = rag_stack.orchestrator(metrics_port=free_ports(1)[0])
    answered, _ = await ask_result(orchestrator.address, "Which river flows through Warsaw?")
    assert answered.status.reason == "", answered.status
    await ask_result(orchestrator.address, "Who won the 2030 FIFA World Cup in Ulaanbaatar?")
    gateway_metrics = free_ports(1)[0]
    gateway = rag_stack.launcher.gateway(
        orchestrator,
        rag_stack.embedding,
        rag_stack.retrieval,
        env={"RAGLINE_GATEWAY_METRICS_PORT": str(gateway_metrics)},
    )
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"http://{gateway.address}/v1/models")).status_code == 200

    services = {
        "budget": rag_stack.budget,
        "embedding": rag_stack.embedding,
        "retrieval": rag_stack.retrieval,
        "rerank": rag_stack.rerank,
        "generation": rag_stack.generation,
        "orchestrator": orchestrator,
        "gateway": gateway,
    }
    wanted = documented()
    every_documented = set().union(*wanted.values())
    missing, undocumented, silent = {}, {}, {}
    for name, handle in services.items():
        found = scrape(handle.metrics_port)
        served = {family for family in found if OURS.match(family)}
        missing[name] = sorted(wanted[name] - served)
        undocumented[name] = sorted(served - every_documented)
        # traffic went through every service: its calls were counted
        silent[name] = not found[
            "ragline_gateway_requests" if name == "gateway" else "grpc_server_handled"
        ]
    assert not any(missing.values()), f"documented, not served: {missing}"
    assert not any(undocumented.values()), f"served, not documented: {undocumented}"
    assert not any(silent.values()), f"no calls counted: {silent}"


def values(port: int) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, of one scrape."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for samples in scrape(port).values()
        for s in samples
    }


async def test_one_answer_moves_every_services_own_metrics(rag_stack):
    orchestrator = rag_stack.orchestrator()
    handles = {
        "embedding": rag_stack.embedding,
        "retrieval": rag_stack.retrieval,
        "rerank": rag_stack.rerank,
        "generation": rag_stack.generation,
        "budget": rag_stack.budget,
    }
    before = {name: values(h.metrics_port) for name, h in handles.items()}
    answered, _ = await ask_result(orchestrator.address, "What religion were the Normans?")
    assert answered.status.reason == "", answered.status
    after = {name: values(h.metrics_port) for name, h in handles.items()}

    def now(service: str, sample: str, **labels: str) -> float:
        return after[service].get((sample, frozenset(labels.items())), 0.0)

    def moved(service: str, sample: str, **labels: str) -> float:
        key = (sample, frozenset(labels.items()))
        return now(service, sample, **labels) - before[service].get(key, 0.0)

    # the question's vector: one urgent run of the embedding model
    urgent = {"batcher": "embedding", "lane": "urgent"}
    assert moved("embedding", "ragline_batch_texts_count", **urgent) >= 1
    # the plan's two searches, BM25 and vector, run apart
    assert moved("retrieval", "ragline_retrieval_search_seconds_count", mode="bm25") >= 1
    assert moved("retrieval", "ragline_retrieval_search_seconds_count", mode="vector") >= 1
    assert now("retrieval", "ragline_retrieval_documents") > 0
    assert now("retrieval", "ragline_retrieval_apply_lag_writes") == 0
    assert now("retrieval", "ragline_retrieval_wal_bytes") > 0
    tokens = {"batcher": "rerank-tokens", "lane": "urgent"}
    assert moved("rerank", "ragline_batch_texts_count", **tokens) >= 1
    # one generation on the small tier, its tokens, its first token timed
    small = {"tier": "small"}
    assert moved("generation", "ragline_generation_requests_total", finish="stop", **small) == 1
    prompt = sum(
        moved("generation", "ragline_generation_tokens_total", kind=kind, **small)
        for kind in ("prompt_computed", "prompt_cached")
    )
    assert prompt > 100
    assert moved("generation", "ragline_generation_tokens_total", kind="completion", **small) >= 1
    assert moved("generation", "ragline_generation_time_to_first_token_seconds_count", **small) == 1
    assert now("generation", "ragline_generation_slots", **small) == 3  # 2 + a priority slot
    assert now("generation", "ragline_generation_slots_busy", **small) == 0
    assert now("generation", "ragline_generation_engine_up", **small) == 1
    # the task's reservations and settlements in the ledger
    assert moved("budget", "ragline_budget_operations_total", operation="reserve", result="ok") >= 2
    assert moved("budget", "ragline_budget_operations_total", operation="settle", result="ok") >= 2
