"""The chart's TLS: a Secret mounted whole in every ragline pod (and the `helm test` pod),
a cert-manager Certificate naming every address a client uses, and probes on the
plaintext health port the kubelet can speak to."""

from __future__ import annotations

import pytest

from support.helm_chart import (
    CHART,
    KEYS,
    OPEN,
    config_map,
    invalid,
    ragline_workloads,
    render,
    secret_holders,
    template,
)

pytestmark = pytest.mark.deploy

MTLS = ["--set", "config.RAGLINE_TLS_MODE=mtls"]
CERT_MANAGER = [
    "--set",
    "tls.certManager.enabled=true",
    "--set",
    "tls.certManager.issuerRef.name=ragline-ca",
]


def test_probes_use_the_plaintext_health_port_and_no_secret_is_mounted_when_open(helm):
    objects = render(helm, CHART, *OPEN)
    config = config_map(objects)
    assert config["RAGLINE_TLS_MODE"] == "off"
    workloads = ragline_workloads(objects)
    assert len(workloads) == 7
    for workload in workloads:
        name = workload["metadata"]["labels"]["app.kubernetes.io/name"]
        if name == "gateway":  # HTTP probes on its own port (tests/deploy/test_helm_chart.py)
            continue
        health_port = int(config[f"RAGLINE_{name.upper()}_HEALTH_PORT"])
        container = workload["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["health"] == health_port != ports["grpc"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health_port, (name, probe)
        assert all(m["name"] != "tls" for m in container["volumeMounts"])
    assert not [o for o in objects if o["kind"] == "Certificate"]
    assert not [o for o in objects if o["metadata"]["name"] in ("rl-tls", "rl-tls-ca")]


def test_mtls_with_cert_manager_names_every_address_and_mounts_the_secret(helm):
    objects = render(helm, CHART, *MTLS, *CERT_MANAGER)
    assert not invalid([o for o in objects if o["kind"] != "Certificate"])
    (certificate,) = [o for o in objects if o["kind"] == "Certificate"]
    spec = certificate["spec"]
    assert spec["issuerRef"] == {"name": "ragline-ca", "kind": "Issuer", "group": "cert-manager.io"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    config = config_map(objects)
    # Every address a ragline client dials is a name the certificate holds.
    addresses = {k: v for k, v in config.items() if k.endswith("_ADDR")}
    assert len(addresses) == 7
    for variable, address in addresses.items():
        host = address.removeprefix("dns:///").rpartition(":")[0]
        assert host in spec["dnsNames"], (variable, host)
    pods = [w["spec"]["template"]["spec"] for w in ragline_workloads(objects)]
    pods += [o["spec"] for o in objects if o["kind"] == "Pod"]  # `helm test`
    assert len(pods) == 8
    for pod in pods:
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == spec["secretName"] == "rl-tls"
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
        assert mount["mountPath"] == "/etc/ragline/tls" and mount["readOnly"] is True
        assert "subPath" not in mount  # a subPath mount is never updated on renewal
    for name in ("CERT", "KEY", "CA"):
        path = config[f"RAGLINE_TLS_{name}_FILE"]
        assert path.startswith("/etc/ragline/tls/")


def test_an_existing_secret_is_mounted_as_it_is(helm):
    objects = render(helm, CHART, *MTLS, "--set", "tls.secretName=ops-issued")
    assert not [o for o in objects if o["kind"] == "Certificate"]
    for workload in ragline_workloads(objects):
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        assert {
            "name": "tls",
            "secret": {"secretName": "ops-issued", "defaultMode": 0o440},
        } in volumes


def test_an_unknown_tls_mode_fails_with_what_to_set(helm):
    unknown = template(helm, *KEYS, "--set", "config.RAGLINE_TLS_MODE=on")
    assert unknown.returncode != 0 and "RAGLINE_TLS_MODE" in unknown.stderr


def test_only_the_budget_pods_hold_the_etcd_password_and_etcd_compacts(helm):
    objects = render(helm, CHART, "--set", "etcd.clientPassword=ledger-secret")
    (secret,) = [
        o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "rl-budget-etcd"
    ]
    assert secret["stringData"] == {"RAGLINE_BUDGET_ETCD_PASSWORD": "ledger-secret"}
    # the budget pods, and the Job that makes the budget's etcd user at install
    assert secret_holders(objects, "rl-budget-etcd") == {"rl-budget", "rl-etcd-setup"}
    (etcd,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-etcd"
    ]
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--auto-compaction-mode=periodic" in args
    assert "--auto-compaction-retention=1h" in args


def test_tokens_verified_by_a_key_set_leave_no_signing_key_in_any_pod(helm):
    objects = render(
        helm,
        CHART,
        "--set",
        "auth.jwtKey=",
        "--set",
        "config.RAGLINE_AUTH_JWKS_URL=file:///etc/ragline/auth/jwks.json",
        "--set",
        "auth.verificationKeysSecret=idp-keys",
    )
    (secret,) = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "rl-auth"]
    assert secret["stringData"]["RAGLINE_AUTH_JWT_KEY"] == ""
    for workload in ragline_workloads(objects):
        spec = workload["spec"]["template"]["spec"]
        assert {
            "name": "auth-keys",
            "secret": {"secretName": "idp-keys", "defaultMode": 0o440},
        } in spec["volumes"]
        mounts = spec["containers"][0]["volumeMounts"]
        assert {"name": "auth-keys", "mountPath": "/etc/ragline/auth", "readOnly": True} in mounts


def test_the_qdrant_key_reaches_the_retrieval_pods_and_qdrant_only(helm):
    objects = render(
        helm, CHART, "--set", "qdrant.enabled=true", "--set", "qdrant.apiKey=vector-key"
    )
    (secret,) = [o for o in objects if o["metadata"]["name"] == "rl-qdrant-key"]
    assert secret["stringData"] == {"RAGLINE_RETRIEVAL_QDRANT_API_KEY": "vector-key"}
    assert secret_holders(objects, "rl-qdrant-key") == {"rl-retrieval"}
    (qdrant,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-qdrant"
    ]
    env = {e["name"]: e for e in qdrant["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["QDRANT__SERVICE__API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "rl-qdrant-key",
        "key": "RAGLINE_RETRIEVAL_QDRANT_API_KEY",
    }


def test_triton_serves_grpc_under_mutual_tls_when_the_stack_does(helm):
    gpu = ["-f", str(CHART / "values-gpu.yaml")]
    objects = render(helm, CHART, *gpu, *MTLS, *CERT_MANAGER)
    config = config_map(objects)
    assert config["RAGLINE_EMBEDDING_TRITON_TLS"] == "true"
    assert config["RAGLINE_GENERATION_TRITON_TLS"] == "true"
    (triton,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "rl-triton"
    ]
    container = triton["spec"]["template"]["spec"]["containers"][0]
    assert {"--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true"} <= set(container["args"])
    assert {"name": "tls", "mountPath": "/etc/ragline/tls", "readOnly": True} in container[
        "volumeMounts"
    ]
    (certificate,) = [o for o in objects if o["kind"] == "Certificate"]
    host = config["RAGLINE_GENERATION_TRITON_URL"].rpartition(":")[0]
    assert host in certificate["spec"]["dnsNames"]
    plain = render(helm, CHART, *gpu, *OPEN)
    config = config_map(plain)
    assert config["RAGLINE_EMBEDDING_TRITON_TLS"] == "false"
    (triton,) = [
        o for o in plain if o["kind"] == "Deployment" and o["metadata"]["name"] == "rl-triton"
    ]
    assert not any("ssl" in a for a in triton["spec"]["template"]["spec"]["containers"][0]["args"])


def test_the_bundled_qdrant_serves_tls_and_retrieval_checks_it(helm):
    objects = render(helm, CHART, *MTLS, *CERT_MANAGER, "--set", "qdrant.enabled=true")
    config = config_map(objects)
    assert config["RAGLINE_RETRIEVAL_QDRANT_URL"] == "rl-qdrant:6334"
    assert config["RAGLINE_RETRIEVAL_QDRANT_CA_FILE"] == "/etc/ragline/tls/ca.crt"
    (qdrant,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-qdrant"
    ]
    container = qdrant["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["QDRANT__SERVICE__ENABLE_TLS"] == "true"
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    (certificate,) = [o for o in objects if o["kind"] == "Certificate"]
    assert (
        "rl-qdrant" in certificate["spec"]["dnsNames"]
        and "rl-redis" in certificate["spec"]["dnsNames"]
    )
    plain = render(helm, CHART, *OPEN, "--set", "qdrant.enabled=true")
    config = config_map(plain)
    assert config["RAGLINE_RETRIEVAL_QDRANT_CA_FILE"] == ""
