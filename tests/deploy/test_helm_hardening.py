"""Every workload of the chart, ragline's and the bundled etcd, Redis, Qdrant and Triton,
runs as a non-root user with no privilege escalation, no capabilities and a read-only root
filesystem, and starts without a shell where its image has none."""

from __future__ import annotations

import pytest

from support.helm_chart import CHART, VALUES, render

pytestmark = pytest.mark.deploy

EVERYTHING = ["--set", "qdrant.enabled=true", "--set", "triton.modelRepositoryClaim=models"]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Pod")]


def pod_spec(workload: dict) -> dict:
    return workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]


@pytest.mark.parametrize("flavour", VALUES)
def test_every_container_runs_unprivileged(helm, flavour):
    objects = render(helm, CHART, *VALUES[flavour], *EVERYTHING)
    names = {w["metadata"]["name"] for w in workloads(objects)}
    assert {"rl-etcd", "rl-redis", "rl-qdrant"} <= names
    if flavour == "gpu":
        assert "rl-triton" in names
    for workload in workloads(objects):
        spec = pod_spec(workload)
        name = workload["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name


def test_the_bundled_etcd_needs_no_shell(helm):
    """etcd's image is distroless: the member's name reaches its flags through the
    environment, never through a shell script."""
    objects = render(helm)
    (etcd,) = [
        o for o in objects if o["metadata"]["name"] == "rl-etcd" and o["kind"] == "StatefulSet"
    ]
    container = pod_spec(etcd)["containers"][0]
    assert container["command"] == ["/usr/local/bin/etcd"]
    assert not any("/bin/sh" in part for part in container["command"] + container["args"])
    assert "--name=$(POD_NAME)" in container["args"]
    assert {
        "name": "POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    } in container["env"]
    peers = next(a for a in container["args"] if a.startswith("--initial-cluster="))
    assert peers.count("=http://rl-etcd-") == 3


def test_the_budget_service_reaches_the_bundled_etcd_by_one_name(helm):
    """etcd's client library takes IP lists or one DNS name: the headless Service's."""
    from ragline_services.budget.store import etcd_target

    objects = render(helm)
    config = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rl-config"
    )
    endpoints = config["data"]["RAGLINE_BUDGET_ETCD_ENDPOINTS"]
    assert etcd_target(endpoints.split(",")) == "dns:///rl-etcd:2379"
    (service,) = [
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "rl-etcd"
    ]
    assert service["spec"]["clusterIP"] == "None"
