"""checkov 3.3 on both renders of the chart: no failed check but those the chart README
lists with a reason (its "checkov" table)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from support import REPO_ROOT
from support.helm_chart import CHART, KEYS, SECURED, VALUES, template

pytestmark = pytest.mark.deploy

CHECKOV = REPO_ROOT / ".venv-checkov" / "bin" / "checkov"
EVERYTHING = ["--set", "qdrant.enabled=true", "--set", "triton.modelRepositoryClaim=models"]


def allowed() -> set[str]:
    """The check ids of the README's checkov table."""
    text = (CHART / "README.md").read_text()
    table = text.split("## checkov", 1)[1].split("\n## ", 1)[0]
    return {
        check
        for row in table.splitlines()
        if row.startswith("| CKV")
        for check in re.findall(r"CKV_K8S_\d+", row.split("|")[1])
    }


def failed_checks(helm: str, tmp_path, *extra: str) -> dict[str, set[str]]:
    if not CHECKOV.exists():
        pytest.fail("checkov is not installed: run `make checkov-env`")
    paths = []
    for flavour, values in VALUES.items():
        rendered = template(helm, *KEYS, *values, *EVERYTHING, *extra)
        assert rendered.returncode == 0, rendered.stderr
        path = tmp_path / f"{flavour}.yaml"
        path.write_text(rendered.stdout)
        paths += ["-f", str(path)]
    scan = subprocess.run(
        [str(CHECKOV), *paths, "--framework", "kubernetes", "-o", "json", "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    reports = json.loads(scan.stdout)
    failed: dict[str, set[str]] = {}
    for report in reports if isinstance(reports, list) else [reports]:
        assert report["summary"]["parsing_errors"] == 0
        for check in report["results"]["failed_checks"]:
            failed.setdefault(check["check_id"], set()).add(check["resource"])
    return failed


@pytest.mark.parametrize("variant", ["default", "secured"])
def test_no_failed_check_beyond_the_readmes_reasons(helm, tmp_path, variant):
    failed = failed_checks(helm, tmp_path, *(SECURED if variant == "secured" else []))
    unexplained = {
        check: sorted(where) for check, where in failed.items() if check not in allowed()
    }
    assert not unexplained, unexplained


def test_the_scan_sees_what_it_is_asked_about(helm, tmp_path):
    """The same scan fails a privileged bundled workload, and a pinned digest passes the
    digest check: the allow-list is not why the first test passes."""
    failed = failed_checks(
        helm,
        tmp_path,
        "--set",
        "redis.securityContext.allowPrivilegeEscalation=true",
        "--set",
        "image.digest=sha256:" + "a" * 64,
    )
    assert "StatefulSet.default.rl-redis" in failed["CKV_K8S_20"]
    assert not any(
        r.startswith("Deployment.default.rl-orchestrator") for r in failed.get("CKV_K8S_43", ())
    )
