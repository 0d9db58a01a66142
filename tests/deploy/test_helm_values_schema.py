"""values.schema.json: helm refuses a misspelt or mistyped value, and a service key too
short to sign with, with a message naming it; the schema is what the tool writes from the
values files."""

from __future__ import annotations

import shutil

import pytest

from support.helm_chart import CHART, OPEN, template, tool_check

pytestmark = pytest.mark.deploy

GOOD_KEYS = ["--set", "auth.jwtKey=client-key", "--set", "auth.serviceKey=" + "s" * 40]


def test_the_schema_is_what_the_tool_writes_from_the_values_files():
    checked = tool_check("make_values_schema.py")
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "services.embeding.replicas=3"], "Additional property embeding is not allowed"),
        (["--set", "services.embedding.replicas=many"], "embedding.replicas: Invalid type"),
        (["--set", "config.RAGLINE_EMBEDING_MODEL=x"], "RAGLINE_EMBEDING_MODEL is not allowed"),
        (["--set", "config.RAGLINE_AUTH_MODE=none"], "config.RAGLINE_AUTH_MODE"),
        (["--set", "monitoring.serviceMonitor.enabled=maybe"], "serviceMonitor.enabled"),
        (["--set", "services.retrieval.kind=DaemonSet"], "services.retrieval.kind"),
    ],
)
def test_a_bad_value_is_refused_naming_it(helm, values, message):
    rendered = template(helm, *GOOD_KEYS, *values)
    assert rendered.returncode != 0
    assert message in rendered.stderr, rendered.stderr


def test_a_service_key_too_short_to_sign_with_is_refused_with_what_to_do(helm):
    rendered = template(helm, "--set", "auth.jwtKey=k", "--set", "auth.serviceKey=short")
    assert rendered.returncode != 0
    assert "auth.serviceKey is 5 characters" in rendered.stderr
    assert "openssl rand -hex 32" in rendered.stderr


def test_good_values_still_render(helm):
    assert template(helm, *GOOD_KEYS).returncode == 0
    gpu = template(helm, *GOOD_KEYS, "-f", str(CHART / "values-gpu.yaml"))
    assert gpu.returncode == 0, gpu.stderr


def notes(helm: str, tmp_path, *values: str) -> str:
    """NOTES.txt as `helm install` prints it (rendered through a copy of the chart that
    holds it as a ConfigMap: `helm template` renders no NOTES and install needs a cluster)."""
    import shutil

    import yaml

    chart = tmp_path / "ragline"
    shutil.copytree(CHART, chart)
    (chart / "notes.src").write_text((chart / "templates" / "NOTES.txt").read_text())
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "notes-check.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n"
        '  notes: |\n{{ tpl (.Files.Get "notes.src") . | indent 4 }}\n'
    )
    rendered = template(helm, "--show-only", "templates/notes-check.yaml", *values, chart=chart)
    assert rendered.returncode == 0, rendered.stderr
    return yaml.safe_load(rendered.stdout)["data"]["notes"]


def test_the_install_notes_say_where_to_call_and_warn_when_authentication_is_off(helm, tmp_path):
    on = notes(helm, tmp_path / "on", *GOOD_KEYS)
    assert "rl-orchestrator.default.svc:50100" in on
    assert "https://rl-gateway.default.svc:8080/v1" in on  # TLS on by default
    # networkPolicy on, clientsFrom empty: the rendered rule admits every pod, and says so
    assert "Any pod in the cluster may call them" in on
    assert "Authentication is on" in on and "rl-auth" in on
    assert "Secured: mutual TLS between every part" in on and "WARNING" not in on
    off = notes(helm, tmp_path / "off", *OPEN, "--set", "config.RAGLINE_AUTH_MODE=off")
    assert "WARNING: authentication is off" in off
    assert "WARNING: insecure is true" in off
    assert "travels in plaintext" in off and "etcd has no authentication" in off


def test_every_setting_the_templates_read_for_a_service_is_accepted_for_each_one():
    """The schema must not refuse what the templates support: a key one service's defaults
    leave out (a node selector, a cache size) is still a setting of every service."""
    import json
    import re

    schema = json.loads((CHART / "values.schema.json").read_text())
    services = schema["properties"]["services"]["properties"]
    read = set()
    for template_file in (CHART / "templates").glob("*.yaml"):
        read |= set(re.findall(r"\$svc\.(\w+)", template_file.read_text()))
    assert {"nodeSelector", "resources", "hpa"} <= read
    for name, entry in services.items():
        assert read <= set(entry["properties"]), (name, sorted(read - set(entry["properties"])))


def test_the_install_notes_give_grpcurl_the_flags_of_the_transport(helm, tmp_path):
    plain = notes(helm, tmp_path / "plain", *GOOD_KEYS, *OPEN)
    assert "grpcurl -plaintext" in plain
    mtls = notes(
        helm,
        tmp_path / "mtls",
        *GOOD_KEYS,
        "--set",
        "config.RAGLINE_TLS_MODE=mtls",
        "--set",
        "tls.secretName=ops-issued",
    )
    assert "-plaintext" not in mtls
    assert "grpcurl -cacert ca.crt -cert tls.crt -key tls.key" in mtls and "ops-issued" in mtls


def test_the_install_notes_say_whether_a_pod_can_sign_tokens(helm, tmp_path):
    hmac = notes(helm, tmp_path / "hmac", *GOOD_KEYS)
    assert "can also sign tokens" in hmac
    keyset = notes(
        helm,
        tmp_path / "keyset",
        *GOOD_KEYS,
        "--set",
        "config.RAGLINE_AUTH_JWKS_URL=https://idp.example/jwks.json",
    )
    assert "hold no key that signs tokens" in keyset and "can also sign" not in keyset


def test_the_chart_installs_as_a_subchart_with_its_parents_global_values(helm, tmp_path):
    """A platform team vendors ragline under its own chart: Helm then hands it `global`."""
    parent = tmp_path / "platform"
    (parent / "charts").mkdir(parents=True)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: platform\nversion: 0.1.0\n")
    shutil.copytree(CHART, parent / "charts" / "ragline")
    keys = [f"ragline.{value}" if flag == "--set" else value for flag, value in pairs(GOOD_KEYS)]
    rendered = template(
        helm, "--set", "global.environment=production", *interleave("--set", keys), chart=parent
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "kind: Deployment" in rendered.stdout


def pairs(flags: list[str]) -> list[tuple[str, str]]:
    return list(zip(flags[::2], flags[1::2], strict=True))


def interleave(flag: str, values: list[str]) -> list[str]:
    return [item for value in values for item in (flag, value)]
