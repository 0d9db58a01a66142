"""The Node.js client (clients/node, @grpc/grpc-js) against the whole stack as real
processes: streams an answer with citations, and reads the rich error details."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from support import REPO_ROOT

pytestmark = pytest.mark.e2e

CLIENT = REPO_ROOT / "clients" / "node"


@pytest.fixture(scope="module")
def node_client():
    if shutil.which("node") is None:
        pytest.fail("node is not installed: the Node.js client test needs it (make node-client)")
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").exists():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENT, check=True, timeout=600
        )
    return CLIENT / "ask.js"


def ask(node_client, address, *args, deadline_ms=90_000):
    return subprocess.run(
        ["node", str(node_client), "--addr", address, "--deadline-ms", str(deadline_ms), *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_node_client_streams_an_answer_with_citations(rag_stack, node_client):
    orchestrator = rag_stack.orchestrator()
    shown = ask(node_client, orchestrator.address, "Which river flows through Warsaw?")
    assert shown.returncode == 0, shown.stderr
    assert "vistula" in shown.stdout.lower()
    assert "Warsaw" in shown.stdout and "status: ANSWER_STATE_" in shown.stdout
    result = json.loads(
        ask(node_client, orchestrator.address, "--json", "Which river flows through Warsaw?").stdout
    )
    assert result["citations"] and result["timing"]["nodes"]
    assert {c["document_id"] for c in result["citations"]} <= {
        e["document_id"] for e in result["evidence"]
    }


def test_node_client_reads_bad_request_and_error_info(rag_stack, node_client):
    orchestrator = rag_stack.orchestrator()
    failed = ask(node_client, orchestrator.address, "x" * 9000)  # over the question limit
    assert failed.returncode == 1
    error = json.loads(failed.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert error["reason"] == "INVALID_ARGUMENT" and error["domain"] == "ragline.dev"
    assert [v["field"] for v in error["fieldViolations"]] == ["question"]
    too_short = ask(node_client, orchestrator.address, "Which river?", deadline_ms=1)
    assert too_short.returncode == 1
    assert json.loads(too_short.stderr.strip().splitlines()[-1])["error"]["code"] == (
        "DEADLINE_EXCEEDED"
    )


@pytest.mark.parametrize(
    ("service", "grpc_service", "method", "field"),
    [
        ("embedding", "EmbeddingService", "Embed", "texts"),
        ("retrieval", "RetrievalService", "Search", "query"),
        ("rerank", "RerankService", "Rerank", "query"),
        ("generation", "GenerationService", "CountTokens", "input"),
        ("budget", "BudgetService", "GetLedger", "task_id"),
    ],
)
def test_node_client_reads_every_services_bad_request(
    all_services, node_client, service, grpc_service, method, field
):
    failed = subprocess.run(
        ["node", str(CLIENT / "call.js"), "--addr", all_services[service].address,
         "--tenant", "acme", grpc_service, method, "{}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stdout + failed.stderr
    error = json.loads(failed.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "INVALID_ARGUMENT" and error["reason"] == "INVALID_ARGUMENT"
    assert field in {v["field"] for v in error["fieldViolations"]}
    worked = subprocess.run(
        ["node", str(CLIENT / "call.js"), "--addr", all_services["retrieval"].address,
         "--tenant", "acme", "RetrievalService", "IndexStatus", "{}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert worked.returncode == 0 and "dim" in json.loads(worked.stdout)


def test_node_over_http_streams_an_answer_and_shows_a_refusal(rag_stack, node_client):
    """ask-http.js: Node's own fetch against the gateway, no packages."""
    gateway = rag_stack.launcher.gateway(
        rag_stack.orchestrator(), rag_stack.embedding, rag_stack.retrieval
    )
    script = node_client.parent / "ask-http.js"
    url = f"http://{gateway.address}"

    def run(question: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["node", str(script), "--url", url, question],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    answered = run("Which river flows through Warsaw?")
    assert answered.returncode == 0, answered.stderr
    assert "vistula" in answered.stdout.lower() and "sources:" in answered.stdout
    assert "state: COMPLETE" in answered.stdout or "state: PARTIAL" in answered.stdout
    refused = run("What is the capital of Australia?")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "(no answer) INCOMPLETE (no_relevant_evidence)" in refused.stdout
