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


def render(helm: str, chart=CHART, *extra: str) -> list[dict]:
    result = subprocess.run(
        [helm, "template", "rl", str(chart), *KEYS, *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


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


def tool_check(tool: str) -> subprocess.CompletedProcess:
    """`tools/<tool> --check`: whether the chart file the tool writes (the values schema,
    the dashboard) is what it would write now."""
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / tool), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
