"""Every workload of the chart, ragline's and the bundled etcd, Redis, Qdrant and Triton,
runs as a non-root user with no privilege escalation, no capabilities and a read-only root
filesystem, and starts without a shell where its image has none."""

from __future__ import annotations

import pytest

from support.helm_chart import (
    CHART,
    KEYS,
    SECURED,
    VALUES,
    config_map,
    pod_spec,
    render,
    secret_holders,
    template,
    workloads,
)

pytestmark = pytest.mark.deploy

EVERYTHING = ["--set", "qdrant.enabled=true", "--set", "triton.modelRepositoryClaim=models"]


@pytest.mark.parametrize("flavour", [*VALUES, "secured"])
def test_every_container_runs_unprivileged(helm, flavour):
    extra = SECURED if flavour == "secured" else VALUES[flavour]
    objects = render(helm, CHART, *extra, *EVERYTHING)
    names = {w["metadata"]["name"] for w in workloads(objects)}
    assert {"rl-etcd", "rl-redis", "rl-qdrant"} <= names
    if flavour == "gpu":
        assert "rl-triton" in names
    if flavour == "secured":
        assert "rl-etcd-setup" in names
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
    assert peers.count("=https://rl-etcd-") == 3  # peers under TLS (etcd.secure, the default)


def test_the_budget_service_reaches_the_bundled_etcd_by_one_name(helm):
    """etcd's client library takes IP lists or one DNS name: the headless Service's."""
    from ragline_services.budget.store import etcd_target

    objects = render(helm)
    config = config_map(objects)
    endpoints = config["RAGLINE_BUDGET_ETCD_ENDPOINTS"]
    assert etcd_target(endpoints.split(",")) == "dns:///rl-etcd:2379"
    (service,) = [
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "rl-etcd"
    ]
    assert service["spec"]["clusterIP"] == "None"


def test_a_secured_bundled_etcd_speaks_mutual_tls_and_a_job_turns_its_auth_on(helm):
    import fnmatch

    from ragline_app.cli import build_parser

    objects = render(helm, CHART, *SECURED)
    (etcd,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-etcd"
    ]
    container = pod_spec(etcd)["containers"][0]
    args = container["args"]
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    assert "--listen-client-urls=https://0.0.0.0:2379" in args
    assert not any("http://rl-etcd" in a for a in args)  # peers under TLS too
    assert container["readinessProbe"]["httpGet"]["port"] == 2381
    # the certificate names every member of the peer list and the name the budget dials
    (certificate,) = [o for o in objects if o["kind"] == "Certificate"]
    names = certificate["spec"]["dnsNames"]
    peers = next(a for a in args if a.startswith("--initial-cluster=")).split("=", 1)[1]
    members = [url.split("://")[1].rsplit(":", 1)[0] for url in peers.split(",")]
    config = config_map(objects)
    dialed = config["RAGLINE_BUDGET_ETCD_ENDPOINTS"].rsplit(":", 1)[0]
    for host in [*members, dialed]:
        assert any(fnmatch.fnmatchcase(host, pattern) for pattern in names), host
    assert config["RAGLINE_BUDGET_ETCD_CA_FILE"] == "/etc/ragline/tls/ca.crt"
    # the setup Job: a real ragline command, the root password and the budget's user
    (job,) = [o for o in objects if o["kind"] == "Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    job_container = job["spec"]["template"]["spec"]["containers"][0]
    assert build_parser().parse_args(job_container["args"]).command == "etcd-setup"
    secrets = {s["secretRef"]["name"] for s in job_container["envFrom"] if "secretRef" in s}
    assert secrets == {"rl-budget-etcd", "rl-etcd-root"}
    (root,) = [o for o in objects if o["metadata"]["name"] == "rl-etcd-root"]
    assert root["stringData"] == {"RAGLINE_ETCD_ROOT_PASSWORD": "root-secret"}
    (policy,) = [
        o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rl-etcd"
    ]
    admitted = [
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in policy["spec"]["ingress"]
        for peer in rule.get("from", [])
        if "podSelector" in peer
    ]
    assert "etcd-setup" in admitted and "budget" in admitted
    # and only the setup Job holds the root password
    assert secret_holders(objects, "rl-etcd-root") == {"rl-etcd-setup"}


def test_a_secured_etcd_without_tls_fails_with_what_to_set(helm):
    plaintext = ["--set", "insecure=true", "--set", "config.RAGLINE_TLS_MODE=off"]
    result = template(helm, *KEYS, *plaintext, "--set", "etcd.secure=true")
    assert result.returncode != 0 and "etcd.secure needs RAGLINE_TLS_MODE on" in result.stderr


def test_every_workload_takes_scheduling_annotations_and_pull_secrets(helm, tmp_path):
    """affinity, tolerations, node selector, pod annotations and pull secrets reach the
    bundled workloads too; extra volumes reach ragline's pods (an external store's CA)."""
    import yaml

    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["stores"]}]}
                ]
            }
        }
    }
    values = {
        "imagePullSecrets": [{"name": "regcred"}],
        "extraVolumes": [{"name": "etcd-ca", "secret": {"secretName": "etcd-ca"}}],
        "extraVolumeMounts": [{"name": "etcd-ca", "mountPath": "/etc/etcd-ca"}],
    }
    for component in ("etcd", "qdrant", "redis", "triton"):
        values[component] = {
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "podAnnotations": {"team": "search"},
            "affinity": affinity,
        }
    extra = tmp_path / "values.yaml"
    extra.write_text(yaml.safe_dump(values))
    gpu = ["-f", str(CHART / "values-gpu.yaml")]
    objects = render(helm, CHART, *EVERYTHING, *gpu, "-f", str(extra))
    bundled = {"rl-etcd", "rl-qdrant", "rl-redis", "rl-triton"}
    assert bundled <= {w["metadata"]["name"] for w in workloads(objects)}
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], name
        if name in bundled:
            assert {"key": "dedicated", "operator": "Exists"} in spec["tolerations"], name
            assert spec["affinity"] == affinity, name
            assert workload["spec"]["template"]["metadata"]["annotations"]["team"] == "search"
        elif workload["kind"] not in ("Pod", "Job"):  # not the hooks (helm test, etcd setup)
            mounts = spec["containers"][0]["volumeMounts"]
            assert {"name": "etcd-ca", "mountPath": "/etc/etcd-ca"} in mounts, name
            assert {"name": "etcd-ca", "secret": {"secretName": "etcd-ca"}} in spec["volumes"], name
