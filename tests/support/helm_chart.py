"""Rendering the Helm chart in tests (tests/deploy): `helm template` with test keys, every
object validated against the Kubernetes API schema."""

from __future__ import annotations

import subprocess
import sys

import yaml

from support import REPO_ROOT

CHART = REPO_ROOT / "deploy" / "k8s" / "helm" / "ragline"
KEYS = ["--set", "auth.jwtKey=test-client-key", "--set", "auth.serviceKey=" + "s" * 40]
VALUES = {"cpu": [], "gpu": ["-f", str(CHART / "values-gpu.yaml")]}
# Everything the chart can secure turned on: mtls from cert-manager, the bundled etcd under
# TLS and auth, Redis's ACL user, Qdrant's API key.
SECURED = [
    "--set", "config.RAGLINE_TLS_MODE=mtls",
    "--set", "tls.certManager.enabled=true",
    "--set", "tls.certManager.issuerRef.name=ragline-ca",
    "--set", "etcd.secure=true",
    "--set", "etcd.rootPassword=root-secret",
    "--set", "etcd.clientPassword=ledger-secret",
    "--set", "config.RAGLINE_BUDGET_ETCD_USERNAME=ledger",
    "--set", "redis.password=cache-secret",
    "--set", "config.RAGLINE_REDIS_USERNAME=ragline",
    "--set", "qdrant.apiKey=vector-key",
]  # fmt: skip


# The chart deliberately open (`insecure`: no TLS, etcd without auth, stores without the
# passwords the chart would make): what the opt-out renders.
OPEN = [
    "--set", "insecure=true",
    "--set", "config.RAGLINE_TLS_MODE=off",
    "--set", "etcd.secure=false",
]  # fmt: skip


def template(helm: str, *values: str, chart=CHART) -> subprocess.CompletedProcess:
    """`helm template` of the chart with `values` (no keys added), as it ran."""
    return subprocess.run(
        [helm, "template", "rl", str(chart), *values],
        capture_output=True,
        text=True,
        timeout=120,
    )


def render(helm: str, chart=CHART, *extra: str) -> list[dict]:
    """The objects of a render with the test keys and `extra`, which must succeed."""
    result = template(helm, *KEYS, *extra, chart=chart)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def config_map(objects: list[dict]) -> dict[str, str]:
    """The services' environment as the chart's ConfigMap holds it."""
    (config,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rl-config"
    ]
    return config["data"]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Pod", "Job")]


def pod_spec(workload: dict) -> dict:
    if workload["kind"] == "Pod":
        return workload["spec"]
    return workload["spec"]["template"]["spec"]


def ragline_workloads(objects: list[dict]) -> list[dict]:
    """The workloads of the ragline services (`ragline serve NAME`)."""
    return [
        o
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        and pod_spec(o)["containers"][0].get("args", [""])[0] == "serve"
    ]


def invalid(objects: list[dict]) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version()
    problems = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.message}")
    return problems


def secret_holders(objects: list[dict], secret: str) -> set[str]:
    """The names of the workloads whose first container takes `secret` as environment."""
    holders = set()
    for workload in objects:
        if workload["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        for source in pod_spec(workload)["containers"][0].get("envFrom", []):
            if source.get("secretRef", {}).get("name") == secret:
                holders.add(workload["metadata"]["name"])
    return holders


def tool_check(tool: str) -> subprocess.CompletedProcess:
    """`tools/<tool> --check`: whether the chart file the tool writes (the values schema,
    the dashboard) is what it would write now."""
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / tool), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
