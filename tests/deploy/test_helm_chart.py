"""The Helm chart (deploy/k8s/helm/ragline): helm lint and helm template with both values
files, every rendered object validated strictly against the Kubernetes API schema, and the
ConfigMap + Secret keys equal to the variables the services read (both ways)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ragline_services.registry import service_names
from support import service_settings
from support.helm_chart import (
    CHART,
    KEYS,
    VALUES,
    config_map,
    invalid,
    pod_spec,
    ragline_workloads,
    render,
    template,
)

pytestmark = pytest.mark.deploy


@pytest.mark.parametrize("flavour", VALUES)
def test_the_chart_lints_renders_and_validates(helm, flavour):
    lint = subprocess.run(
        [helm, "lint", "--strict", str(CHART), *KEYS, *VALUES[flavour]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    objects = render(helm, CHART, *VALUES[flavour])
    assert not invalid(objects)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for service in ("orchestrator", "embedding", "rerank", "generation", "budget", "gateway"):
        assert ("Deployment", f"rl-{service}") in kinds
        assert ("HorizontalPodAutoscaler", f"rl-{service}") in kinds
        assert ("PodDisruptionBudget", f"rl-{service}") in kinds
    assert ("StatefulSet", "rl-retrieval") in kinds and ("StatefulSet", "rl-etcd") in kinds
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    ragline = [
        w for w in workloads if w["spec"]["template"]["spec"]["containers"][0]["args"][0] == "serve"
    ]
    assert len(ragline) == 7
    for workload in ragline:
        container = workload["spec"]["template"]["spec"]["containers"][0]
        if container["name"] == "gateway":  # HTTP: its own routes
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            # it holds no key: the callers' tokens go through to the services
            assert container["envFrom"] == [{"configMapRef": {"name": "rl-config"}}]
            continue
        assert container["readinessProbe"]["grpc"]["service"].startswith("ragline.v1.")
        assert container["livenessProbe"]["grpc"]["service"] == "liveness"
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > 20  # the service's own shutdown grace fits inside it
    services = [
        o
        for o in objects
        if o["kind"] == "Service"
        and o["metadata"]["name"]
        in {f"rl-{w['metadata']['labels']['app.kubernetes.io/name']}" for w in ragline}
    ]
    assert len(services) == 7
    assert {s["metadata"]["name"]: s["spec"]["ports"][0]["appProtocol"] for s in services} == {
        **{f"rl-{name}": "grpc" for name in service_names()},
        "rl-gateway": "https",  # TLS is on by default
    }
    # and each serves its metrics (docs/operations.md) on a port of its own
    assert all(s["spec"]["ports"][1]["name"] == "metrics" for s in services)
    triton = [w for w in workloads if w["metadata"]["name"] == "rl-triton"]
    if flavour == "gpu":
        limits = triton[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    else:
        assert not triton


def test_stateless_inner_services_are_called_through_a_headless_name_of_every_pod(helm):
    objects = render(helm)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    config = config_map(objects)
    for name, port in (
        ("embedding", 50101),
        ("rerank", 50103),
        ("generation", 50104),
        ("budget", 50105),
    ):
        headless = services[f"rl-{name}-pods"]["spec"]
        assert headless["clusterIP"] == "None"
        assert headless["selector"] == services[f"rl-{name}"]["spec"]["selector"]
        # gRPC's DNS resolver, so the kit's client goes round-robin over every pod
        assert config[f"RAGLINE_{name.upper()}_ADDR"] == (
            f"dns:///rl-{name}-pods.default.svc:{port}"
        )
        assert int(config[f"RAGLINE_{name.upper()}_MAX_CONNECTION_AGE_S"]) > 0


def test_inner_services_accept_only_the_services_that_call_them(helm):
    objects = render(helm)
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}

    def callers(name):
        rule = policies[f"rl-{name}"]["spec"]["ingress"][0]["from"]
        return {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in rule}

    # and the chart's test pod, which asks their health (`helm test`); retrieval tells rerank
    # and generation which documents were deleted (their copies go too)
    assert callers("budget") == {"orchestrator", "helm-test"}
    for keeper in ("rerank", "generation"):
        assert callers(keeper) == {"orchestrator", "retrieval", "helm-test"}, keeper
    # retrieval embeds queries; the HTTP gateway serves /v1/embeddings, /v1/search and
    # /v1/documents
    assert callers("embedding") == {"orchestrator", "retrieval", "gateway", "helm-test"}
    assert callers("retrieval") == {"orchestrator", "gateway", "helm-test"}
    # and the Job that turns etcd's auth on at install (etcd.secure, the default)
    assert callers("etcd") == {"budget", "etcd", "etcd-setup"}


def test_helm_test_asks_every_service_health_and_the_policies_let_it(helm):
    """`helm test`: one hook pod running `ragline health` with the services' own addresses;
    every ragline service's NetworkPolicy admits it, the orchestrator's too when clients are
    limited (`networkPolicy.clientsFrom`); it holds no API token and no key."""
    clients = "networkPolicy.clientsFrom[0].namespaceSelector.matchLabels.team=search"
    objects = render(helm, CHART, "--set", clients)
    (pod,) = [o for o in objects if o["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    container = spec["containers"][0]
    assert container["args"][0] == "health"
    assert container["envFrom"] == [{"configMapRef": {"name": "rl-config"}}]  # no secret
    labels = pod["metadata"]["labels"]
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    admitted = {
        p["metadata"]["name"]
        for p in policies
        for rule in p["spec"]["ingress"]
        for peer in rule.get("from", [])
        if "podSelector" in peer
        and peer["podSelector"].get("matchLabels", {}).items() <= labels.items()
    }
    services = {"orchestrator", "embedding", "retrieval", "rerank", "generation", "budget"}
    assert {f"rl-{s}" for s in {*services, "gateway"}} <= admitted
    assert not admitted & {"rl-etcd", "rl-redis", "rl-qdrant", "rl-triton"}


def test_a_broken_template_fails_the_check(helm, tmp_path):
    chart = tmp_path / "ragline"
    shutil.copytree(CHART, chart)
    services = chart / "templates" / "services.yaml"
    services.write_text(services.read_text().replace("containerPort:", "containerPorts:"))
    problems = invalid(render(helm, chart))
    assert len(problems) == 7 and all("containerPort" in p for p in problems)
    services.write_text(services.read_text().replace("{{- end }}\n", "", 1))
    broken = subprocess.run(
        [helm, "template", "rl", str(chart), *KEYS], capture_output=True, text=True, timeout=120
    )
    assert broken.returncode != 0


def config_keys(objects: list[dict]) -> set[str]:
    """The variables the chart hands the services: its config ConfigMap, and the Secrets
    the services' containers take as environment (not the stores' own, nor certificates)."""
    as_env = {
        source["secretRef"]["name"]
        for workload in ragline_workloads(objects)
        for source in pod_spec(workload)["containers"][0].get("envFrom", [])
        if "secretRef" in source
    }
    keys = set()
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-config"):
            keys |= set(obj["data"])
        elif obj["kind"] == "Secret" and obj["metadata"]["name"] in as_env:
            keys |= set(obj.get("stringData", {})) | set(obj.get("data", {}))
    return keys


def test_every_variable_the_services_read_is_in_the_chart_and_nothing_else(helm):
    read, chart = set(service_settings()), config_keys(render(helm))
    assert not read - chart, f"read by the services, missing from the chart: {read - chart}"
    assert not chart - read, f"in the chart, read by no service: {chart - read}"


def test_the_parity_check_fails_when_one_side_gains_a_variable(helm, tmp_path):
    chart = tmp_path / "ragline"
    shutil.copytree(CHART, chart)
    # The schema would refuse the unknown key first; the parity check itself must see it.
    (chart / "values.schema.json").unlink()
    values = chart / "values.yaml"
    values.write_text(values.read_text() + '  RAGLINE_EMBEDDING_NOT_A_SETTING: "1"\n')
    assert config_keys(render(helm, chart)) - set(service_settings()) == {
        "RAGLINE_EMBEDDING_NOT_A_SETTING"
    }
    read = set(service_settings()) | {"RAGLINE_RERANK_NEW_KNOB"}
    assert read - config_keys(render(helm)) == {"RAGLINE_RERANK_NEW_KNOB"}


def test_no_pod_holds_an_api_token_and_a_key_change_rolls_the_ragline_pods(helm):
    objects = render(helm, CHART, "--set", "qdrant.enabled=true", "--set",
                     "imagePullSecrets[0].name=regcred")  # fmt: skip
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) >= 9
    for workload in workloads:
        assert workload["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    accounts = [o for o in objects if o["kind"] == "ServiceAccount"]
    assert [a["metadata"]["name"] for a in accounts] == ["rl"]
    assert accounts[0]["automountServiceAccountToken"] is False
    ragline = [w for w in workloads if w["spec"]["template"]["spec"].get("serviceAccountName")]
    assert len(ragline) == 7
    for workload in ragline:
        assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]

    def auth_checksums(*keys: str) -> set[str]:
        rendered = render(helm, CHART, *keys)
        return {
            o["spec"]["template"]["metadata"]["annotations"]["checksum/auth"]
            for o in rendered
            if o["kind"] in ("Deployment", "StatefulSet")
            and "checksum/auth" in o["spec"]["template"]["metadata"].get("annotations", {})
        }

    before = auth_checksums()
    after = auth_checksums("--set", "auth.jwtKey=another-client-key")
    assert len(before) == len(after) == 1 and before != after


def test_the_gateway_ingress_renders_for_its_host_and_refuses_without_one(helm):
    ingress = ("--set", "services.gateway.ingress.enabled=true")
    objects = render(
        helm, CHART, *ingress, "--set", "services.gateway.ingress.host=rag.example.com",
        "--set", "services.gateway.ingress.tlsSecretName=rag-tls",
    )  # fmt: skip
    assert not invalid(objects)
    (made,) = [o for o in objects if o["kind"] == "Ingress"]
    rule = made["spec"]["rules"][0]
    assert rule["host"] == "rag.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rl-gateway", "port": {"name": "http"}}
    assert made["spec"]["tls"] == [{"hosts": ["rag.example.com"], "secretName": "rag-tls"}]
    assert not [o for o in render(helm) if o["kind"] == "Ingress"]  # off by default
    refused = template(helm, *KEYS, *ingress)
    assert refused.returncode != 0 and "ingress.host is required" in refused.stderr


def test_the_bundled_qdrant_is_a_version_the_client_speaks_to():
    """Qdrant's clients speak to servers one minor version apart at most (qdrant-client
    warns past that): the chart's image moves with the pinned client."""
    from importlib.metadata import version

    import yaml

    image = yaml.safe_load((CHART / "values.yaml").read_text())["qdrant"]["image"]
    server = [int(p) for p in image.rpartition(":v")[2].split(".")[:2]]
    client = [int(p) for p in version("qdrant-client").split(".")[:2]]
    assert server[0] == client[0] and abs(server[1] - client[1]) <= 1, (image, client)


def test_extra_peers_reach_the_inner_services_and_no_store(helm):
    extra = "networkPolicy.extraIngress[0].namespaceSelector.matchLabels.team=ops"
    gpu = ["-f", str(CHART / "values-gpu.yaml"), "--set", "qdrant.enabled=true"]
    objects = render(helm, CHART, *gpu, "--set", extra)
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    ops = {"namespaceSelector": {"matchLabels": {"team": "ops"}}}
    for name in ("embedding", "retrieval", "rerank", "generation", "budget"):
        assert ops in policies[f"rl-{name}"]["spec"]["ingress"][0]["from"], name
    for store in ("etcd", "redis", "qdrant", "triton"):
        assert ops not in policies[f"rl-{store}"]["spec"]["ingress"][0]["from"], store
