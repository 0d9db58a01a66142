"""Every service answers the on-call toolbox: grpcurl list / describe / health / errors."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from ragline_services.registry import load_spec, service_names
from support import REPO_ROOT

pytestmark = pytest.mark.integration


def grpcurl(binary: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary, "-plaintext", "-max-time", "10", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("name", service_names())
def test_list_shows_service_health_and_reflection(name, all_services, grpcurl_bin):
    result = grpcurl(grpcurl_bin, all_services[name].address, "list")
    assert result.returncode == 0, result.stderr
    listed = set(result.stdout.split())
    assert listed == {
        load_spec(name).grpc_service,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }


@pytest.mark.parametrize("name", service_names())
async def test_reflection_v1_lists_and_describes_the_service(name, all_services):
    """What current grpcurl and Postman ask first (the grpcurl here speaks v1alpha only)."""
    import grpc
    from google.protobuf import descriptor_pb2

    from ragline.server import reflection_v1

    spec = load_spec(name)
    info = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    requests = [
        reflection_v1.ServerReflectionRequest(list_services=""),
        reflection_v1.ServerReflectionRequest(file_containing_symbol=spec.grpc_service),
    ]
    async with grpc.aio.insecure_channel(all_services[name].address) as channel:
        call = channel.stream_stream(
            info,
            request_serializer=reflection_v1.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_v1.ServerReflectionResponse.FromString,
        )
        listed, described = [reply async for reply in call(iter(requests), timeout=10)]
    names = {s.name for s in listed.list_services_response.service}
    assert {spec.grpc_service, reflection_v1.SERVICE_NAME} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    short = spec.grpc_service.rpartition(".")[2]
    assert any(s.name == short for f in files for s in f.service), files


@pytest.mark.parametrize("name", service_names())
def test_describe_shows_every_rpc(name, all_services, grpcurl_bin):
    from google.protobuf import descriptor_pool

    spec = load_spec(name)
    result = grpcurl(grpcurl_bin, all_services[name].address, "describe", spec.grpc_service)
    assert result.returncode == 0, result.stderr
    service = descriptor_pool.Default().FindServiceByName(spec.grpc_service)
    assert service.methods, spec.grpc_service
    for method in service.methods:
        assert f"rpc {method.name} (" in result.stdout


@pytest.mark.parametrize("name", service_names())
def test_health_check_reports_serving(name, all_services, grpcurl_bin):
    address = all_services[name].address
    overall = grpcurl(grpcurl_bin, address, "grpc.health.v1.Health/Check")
    assert overall.returncode == 0, overall.stderr
    assert json.loads(overall.stdout) == {"status": "SERVING"}
    per_service = grpcurl(
        grpcurl_bin,
        "-d",
        json.dumps({"service": load_spec(name).grpc_service}),
        address,
        "grpc.health.v1.Health/Check",
    )
    assert json.loads(per_service.stdout) == {"status": "SERVING"}
    unknown = grpcurl(
        grpcurl_bin, "-d", '{"service": "no.such.Service"}', address, "grpc.health.v1.Health/Check"
    )
    assert "NotFound" in unknown.stderr


def test_describe_shows_field_rules(all_services, grpcurl_bin):
    result = grpcurl(
        grpcurl_bin, all_services["retrieval"].address, "describe", "ragline.v1.SearchRequest"
    )
    assert result.returncode == 0, result.stderr
    assert "required:true" in result.stdout and "max:1000" in result.stdout


def test_bad_request_names_fields_through_grpcurl(all_services, grpcurl_bin):
    result = grpcurl(
        grpcurl_bin,
        "-H",
        "x-ragline-tenant: acme",
        "-d",
        '{"query": "", "k": 5000, "mode": 9}',
        all_services["retrieval"].address,
        "ragline.v1.RetrievalService/Search",
    )
    assert result.returncode != 0
    assert "Code: InvalidArgument" in result.stderr
    for field in ("query", "k", "mode"):
        assert f'"field":"{field}"' in result.stderr.replace(" ", "")


def test_rerank_through_grpcurl(all_services, grpcurl_bin):
    body = {
        "query": "Which river flows through Warsaw?",
        "candidates": [
            {"id": "paris", "text": "Paris. The Seine flows through Paris."},
            {"id": "warsaw", "text": "Warsaw. The Vistula River flows through Warsaw."},
        ],
        "top_k": 1,
    }
    result = grpcurl(
        grpcurl_bin,
        "-H",
        "x-ragline-tenant: acme",
        "-d",
        json.dumps(body),
        all_services["rerank"].address,
        "ragline.v1.RerankService/Rerank",
    )
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert [r["id"] for r in reply["results"]] == ["warsaw"]
    assert reply["stages_run"] == ["RERANK_STAGE_LATE_INTERACTION", "RERANK_STAGE_CROSS_ENCODER"]


def _readme_budget_commands() -> list[tuple[str, str, str]]:
    """The (json body, method) of each grpcurl budget example in README.md."""
    import re

    readme = (REPO_ROOT / "README.md").read_text()
    pattern = re.compile(
        r"""grpcurl -plaintext -H "\$T" -d '(?P<body>[^']*)' \$B """
        r"(?P<method>ragline\.v1\.BudgetService/\w+)"
    )
    return [(m["body"], m["method"]) for m in pattern.finditer(readme)]


def test_readme_budget_examples_run_as_documented(all_services, grpcurl_bin):
    commands = _readme_budget_commands()
    assert [m.rsplit("/", 1)[1] for _, m in commands] == [
        "OpenTask",
        "Reserve",
        "Reserve",
        "Settle",
        "Reserve",
        "Cancel",
        "GetLedger",
        "CloseTask",
    ]
    tenant = f"readme-{uuid.uuid4().hex[:8]}"
    outputs = []
    for body, method in commands:
        result = grpcurl(
            grpcurl_bin,
            "-H",
            f"x-ragline-tenant: {tenant}",
            "-d",
            body,
            all_services["budget"].address,
            method,
        )
        outputs.append(result)
    refused = outputs[2]
    assert "Code: ResourceExhausted" in refused.stderr
    assert "remaining: input_tokens=0, output_tokens=400, cost_micros=0, calls=9" in refused.stderr
    for result in outputs[:2] + outputs[3:]:
        assert result.returncode == 0, result.stderr
    ledger = json.loads(outputs[6].stdout)
    assert ledger["used"] == {"outputTokens": "412", "calls": "1"} or ledger["used"] == {
        "output_tokens": "412",
        "calls": "1",
    }
    assert json.loads(outputs[7].stdout)["ledger"]["state"] == "TASK_STATE_CLOSED"


def test_readme_ask_example_runs_as_documented(all_services, grpcurl_bin):
    import re
    import shlex

    readme = (REPO_ROOT / "README.md").read_text()
    example = re.search(r"grpcurl -plaintext -H 'x-ragline-tenant: default'.*?/Ask", readme, re.S)
    assert example, "README lost its Ask example"
    args = shlex.split(example.group(0).replace("\\\n", " "))[1:]
    args = [all_services["orchestrator"].address if a == "127.0.0.1:50100" else a for a in args]
    result = grpcurl(grpcurl_bin, *args)
    assert result.returncode == 0, result.stderr
    # Nothing is ingested for this tenant in the shared stack: an honest INCOMPLETE answer,
    # with the timing report and the ledger, after the node events.
    messages = [json.loads(m) for m in re.split(r"(?<=})\n(?={)", result.stdout.strip())]
    assert "node" in messages[0] and "result" in messages[-1]
    final = messages[-1]["result"]
    assert final["status"]["reason"] == "no_evidence", final
    assert final["timing"]["nodes"] and final["budget"]["state"] == "TASK_STATE_CLOSED"


def test_every_recipe_of_the_client_guide_runs(all_services, grpcurl_bin):
    """docs/clients.md's grpcurl recipes, as written, against every service (ports swapped
    for the test's, the tenant made unique so the budget ids are fresh)."""
    import re
    import shlex
    import uuid

    from ragline_services.registry import default_port

    guide = (REPO_ROOT / "docs" / "clients.md").read_text()
    block = guide.split("## grpcurl recipes", 1)[1].replace("\\\n", " ")
    commands, pending = [], ""
    for line in block.splitlines():
        if not pending and not line.startswith("grpcurl "):
            continue
        pending = f"{pending}\n{line}" if pending else line
        try:  # a JSON body may span lines inside its quotes
            shlex.split(pending, comments=True)
        except ValueError:
            continue
        commands.append(pending)
        pending = ""
    assert len(commands) >= 17
    ports = {f"127.0.0.1:{default_port(n)}": h.address for n, h in all_services.items()}
    header = f"x-ragline-tenant: guide-{uuid.uuid4().hex[:8]}"
    for command in commands:
        args = shlex.split(command, comments=True)[1:]
        args = [ports.get(a, a) for a in args]
        args = [header if a == "$T" else a for a in args]
        args = ["x-ragline-scopes: ragline:write" if a == "$W" else a for a in args]
        args = [a for a in args if a != "-plaintext"]
        result = grpcurl(grpcurl_bin, *args)
        assert result.returncode == 0, (command, result.stderr)
        assert not re.search(r"^ERROR", result.stderr, re.M), (command, result.stderr)
