"""The chart's monitoring (templates/monitoring.yaml): the ServiceMonitor and PrometheusRule
render where the Prometheus Operator's API is served (or a value says so) and validate
against the operator's models; the dashboard ships as the file tools/make_dashboard.py
writes; every PromQL expression in the alerts and the dashboard parses and reads only
metrics docs/operations.md documents; an HPA can scale on a ragline metric."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from support import REPO_ROOT
from support.helm_chart import CHART, OPEN, SECURED, VALUES, invalid, render, tool_check

pytestmark = pytest.mark.deploy

OPERATOR_API = ["--api-versions", "monitoring.coreos.com/v1"]
OPERATOR_KINDS = ("ServiceMonitor", "PrometheusRule")
OPERATIONS = REPO_ROOT / "docs" / "operations.md"
# A histogram's and a counter's series, as a query names them.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `([a-z_:]+)` \|", OPERATIONS.read_text(), flags=re.M))


def operator_invalid(obj: dict) -> str | None:
    """Why the operator's API would refuse `obj` (its models: types, patterns, and no field
    it does not know), or None."""
    from cloudcoil.models.prometheus_operator import v1
    from pydantic import ValidationError

    model = getattr(v1, obj["kind"])
    try:
        parsed = model.model_validate(obj)
    except ValidationError as error:
        return str(error)
    # The models ignore fields they do not know: a round trip that loses one is refused.
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if kept != obj:
        return f"fields the operator does not know: {json.dumps(obj)} != {json.dumps(kept)}"
    return None


def selectors(expr: str) -> set[str]:
    """The metric names an expression reads."""
    import promql_parser

    names: set[str] = set()

    def walk(node) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            names.add(node.name)
            return
        for field in ("lhs", "rhs", "expr", "args", "vector_selector", "param"):
            child = getattr(node, field, None)
            for item in child if isinstance(child, list) else [child]:
                if type(item).__module__.startswith("promql_parser"):
                    walk(item)

    walk(promql_parser.parse(expr))
    return names


# Series Prometheus writes itself for every target it scrapes.
PROMETHEUS_OWN = {"up"}


def undocumented(exprs: list[str]) -> set[str]:
    known = documented_metrics() | PROMETHEUS_OWN
    unknown = set()
    for expr in exprs:
        for name in selectors(expr):
            if name in known:
                continue
            base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
            if base not in known and f"{base}_total" not in known:
                unknown.add(name)
    return unknown


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def test_the_operator_objects_render_with_its_api_and_validate(helm):
    objects = render(helm, CHART, *OPERATOR_API)
    ours = [o for o in objects if o["kind"] in OPERATOR_KINDS]
    assert sorted(o["kind"] for o in ours) == ["PrometheusRule", "ServiceMonitor"]
    assert {o["kind"]: operator_invalid(o) for o in ours} == {k: None for k in OPERATOR_KINDS}
    assert not invalid([o for o in objects if o["kind"] not in OPERATOR_KINDS])
    monitor = by_kind(objects, "ServiceMonitor")[0]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # it selects exactly the seven services, the bundled etcd and Redis's exporter (Triton:
    # GPU values only), each with a port of that name
    selected = [
        s
        for s in by_kind(objects, "Service")
        if all(
            s["metadata"]["labels"].get(k) == v
            for k, v in monitor["spec"]["selector"]["matchLabels"].items()
        )
    ]
    assert sorted(s["metadata"]["name"] for s in selected) == sorted(
        f"rl-{name}"
        for name in (
            "orchestrator",
            "embedding",
            "retrieval",
            "rerank",
            "generation",
            "budget",
            "gateway",
            "etcd",
            "redis",
        )
    )
    assert all("metrics" in {p["name"] for p in s["spec"]["ports"]} for s in selected)


def test_the_validation_refuses_what_the_operator_would(helm):
    monitor = by_kind(render(helm, CHART, *OPERATOR_API), "ServiceMonitor")[0]
    monitor["spec"]["endpoints"][0]["scrapeInterval"] = "30s"  # the field is `interval`
    assert "does not know" in operator_invalid(monitor)
    rule = by_kind(render(helm, CHART, *OPERATOR_API), "PrometheusRule")[0]
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    assert "for" in operator_invalid(rule)


def test_without_the_api_they_render_only_when_asked(helm):
    kinds = {o["kind"] for o in render(helm)}
    assert not kinds & set(OPERATOR_KINDS)
    asked = render(
        helm,
        CHART,
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
    )
    assert {o["kind"] for o in asked} >= set(OPERATOR_KINDS)
    off = render(helm, CHART, *OPERATOR_API, "--set", "monitoring.serviceMonitor.enabled=false")
    assert "ServiceMonitor" not in {o["kind"] for o in off}


def test_every_alert_parses_and_reads_documented_metrics(helm):
    rule = by_kind(render(helm, CHART, *OPERATOR_API), "PrometheusRule")[0]
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    names = {a["alert"] for a in alerts}
    for wanted in (
        "RaglineErrorRatioHigh",
        "RaglineLatencyHigh",
        "RaglineOrchestratorSaturated",
        "RaglineBatcherSaturated",
        "RaglineGenerationSaturated",
        "RaglineAnswerCacheHitRateLow",
        "RaglineBudgetLedgerUnreachable",
        "RaglineBudgetRefusals",
        "RaglineGenerationEngineDown",
        "RaglineRetrievalApplyStuck",
        "RaglineTargetDown",
    ):
        assert wanted in names
    for alert in alerts:
        # docs/operations.md says what to do when it fires, and the alert links there
        assert f"### {alert['alert']}" in OPERATIONS.read_text(), alert["alert"]
        runbook = alert["annotations"]["runbook_url"]
        assert runbook.endswith(f"docs/operations.md#{alert['alert'].lower()}"), runbook
    assert undocumented([a["expr"] for a in alerts]) == set()
    assert undocumented(["rate(ragline_not_a_metric_total[5m])"]) == {"ragline_not_a_metric_total"}


def test_the_dashboard_is_current_and_reads_documented_metrics(helm):
    check = tool_check("make_dashboard.py")
    assert check.returncode == 0, check.stderr
    config = next(
        o
        for o in render(helm)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")
    )
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config["data"]["ragline.json"])
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Overview",
        "Orchestrator",
        "Embedding",
        "Retrieval",
        "Rerank",
        "Generation",
        "Budget",
        "Gateway (HTTP)",
    ]
    exprs = [
        target["expr"].replace("$__rate_interval", "5m")
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    assert undocumented(exprs) == set()
    # and every documented metric is on the dashboard somewhere
    read = set().union(*(selectors(e) for e in exprs))
    shown = {next((n.removesuffix(s) for s in SUFFIXES if n.endswith(s)), n) for n in read}
    assert {m.removesuffix("_total") for m in documented_metrics()} - shown == set()


def test_an_hpa_can_scale_on_a_ragline_metric(helm):
    objects = render(
        helm,
        CHART,
        "--set",
        "services.generation.hpa.cpuUtilization=0",
        "--set",
        "services.generation.hpa.podMetrics[0].name=ragline_generation_slots_busy",
        "--set",
        "services.generation.hpa.podMetrics[0].averageValue=1500m",
    )
    assert not invalid(objects)
    hpa = next(
        o
        for o in by_kind(objects, "HorizontalPodAutoscaler")
        if o["metadata"]["name"] == "rl-generation"
    )
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "ragline_generation_slots_busy"},
                "target": {"type": "AverageValue", "averageValue": "1500m"},
            },
        }
    ]
    nothing = subprocess.run(
        [
            helm,
            "template",
            "rl",
            str(REPO_ROOT / "deploy/k8s/helm/ragline"),
            "--set",
            "auth.existingSecret=s",
            "--set",
            "services.generation.hpa.cpuUtilization=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert nothing.returncode != 0 and "cpuUtilization or podMetrics" in nothing.stderr


def test_the_bundled_servers_are_scraped_on_their_own_metrics_ports(helm):
    """Triton (GPU values) and etcd serve their own metrics, Redis through the exporter beside
    it; the ServiceMonitor selects their Services, whose `metrics` port is a container's,
    which the scrapers' policy admits."""
    objects = render(helm, CHART, *OPERATOR_API, *VALUES["gpu"])
    monitor = by_kind(objects, "ServiceMonitor")[0]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    workloads = {w["metadata"]["name"]: w for w in objects if w["kind"] in KINDS}
    for name, port in (("rl-triton", 8002), ("rl-etcd", 2381), ("rl-redis", 9121)):
        service = services[name]
        assert wanted.items() <= service["metadata"]["labels"].items(), name
        (metrics,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
        assert metrics["port"] == port
        containers = workloads[name]["spec"]["template"]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for c in containers for p in c["ports"]}
        assert named["metrics"] == port, name
    etcd = workloads["rl-etcd"]["spec"]["template"]["spec"]["containers"][0]
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in etcd["command"] + etcd.get("args", [])


KINDS = ("Deployment", "StatefulSet")


def qdrant_scrape(objects: list[dict]) -> tuple[dict | None, dict]:
    """The ServiceMonitor that selects the bundled Qdrant's Service (None: none does), and
    that Service."""
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == "rl-qdrant"]
    labels = service["metadata"]["labels"]
    monitors = [
        m
        for m in by_kind(objects, "ServiceMonitor")
        if m["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert len(monitors) <= 1
    return (monitors[0] if monitors else None), service


def test_the_bundled_qdrant_is_scraped_with_its_read_only_key_or_not_at_all(helm):
    """Qdrant serves /metrics on its REST port and, with an API key, asks every REST call
    for a key: Prometheus sends the read-only one (never the retrieval pods' key), over TLS
    where Qdrant serves TLS; without a read-only key it is not scraped (a scrape that can
    only fail would raise RaglineTargetDown)."""
    scrapers = ["--set", "monitoring.scrapersFrom[0].namespaceSelector.matchLabels.name=mon"]
    open_qdrant = [*OPERATOR_API, *scrapers, *OPEN, "--set", "qdrant.enabled=true"]
    objects = render(helm, CHART, *open_qdrant)
    monitor, service = qdrant_scrape(objects)
    assert monitor is not None and not operator_invalid(monitor)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert "authorization" not in endpoint and "scheme" not in endpoint
    assert "http" in {p["name"] for p in service["spec"]["ports"]}
    policies = {p["metadata"]["name"]: p for p in by_kind(objects, "NetworkPolicy")}
    admitted = policies["rl-qdrant-metrics"]["spec"]["ingress"][0]["ports"]
    assert admitted == [{"port": 6333, "protocol": "TCP"}]

    keyed = [*open_qdrant, "--set", "qdrant.apiKey=admin-key"]
    assert qdrant_scrape(render(helm, CHART, *keyed))[0] is None  # no key to read with

    secured = [*OPERATOR_API, *scrapers, "--set", "qdrant.enabled=true", *SECURED]
    objects = render(helm, CHART, *secured, "--set", "qdrant.metricsApiKey=read-key")
    monitor, _ = qdrant_scrape(objects)
    (endpoint,) = monitor["spec"]["endpoints"]
    secret_name = endpoint["authorization"]["credentials"]["name"]
    (secret,) = [s for s in by_kind(objects, "Secret") if s["metadata"]["name"] == secret_name]
    assert secret["stringData"][endpoint["authorization"]["credentials"]["key"]] == "read-key"
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["serverName"] == "rl-qdrant"
    (qdrant,) = [w for w in by_kind(objects, "StatefulSet") if w["metadata"]["name"] == "rl-qdrant"]
    env = {e["name"]: e for e in qdrant["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["QDRANT__SERVICE__READ_ONLY_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
        secret_name
    )
    # (cert-manager's Certificate has no schema here)
    assert not invalid([o for o in objects if o["kind"] not in (*OPERATOR_KINDS, "Certificate")])
