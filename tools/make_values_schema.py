"""Write the chart's values.schema.json from its values files, so that `helm install`,
`helm upgrade`, `helm template` and `helm lint` refuse a misspelt or mistyped value with a
message instead of rendering a chart that ignores it.

    .venv/bin/python tools/make_values_schema.py [--check]

Every mapping in values.yaml (and values-gpu.yaml) becomes a closed object of the keys it
has, each typed by its default; the maps that hold Kubernetes objects or free labels stay
open (OPEN below); a few values have rules of their own (RULES). Rules a schema words
badly (a key's length) are `fail`s in the templates instead. `--check` fails when the
committed schema is not what this writes (tests/deploy runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "helm" / "ragline"
SCHEMA = CHART / "values.schema.json"

# Paths (dotted; `*` for any key) whose value is Kubernetes' own or free-form.
OPEN = {
    "imagePullSecrets",
    "podAnnotations",
    "affinity",
    "tolerations",
    "services.*.resources",
    "services.*.hpa.podMetrics",
    "services.gateway.ingress.annotations",
    "networkPolicy.clientsFrom",
    "networkPolicy.extraIngress",
    "monitoring.serviceMonitor.labels",
    "monitoring.prometheusRule.labels",
    "monitoring.dashboard.labels",
    "monitoring.dashboard.annotations",
    "monitoring.scrapersFrom",
    "etcd.resources",
    "qdrant.resources",
    "redis.resources",
    "triton.resources",
    "triton.nodeSelector",
    "triton.tolerations",
    "*.podSecurityContext",
    "extraVolumes",
    "extraVolumeMounts",
    "*.nodeSelector",
    "*.affinity",
    "*.tolerations",
    "*.podAnnotations",
    "*.securityContext",
}

RULES: dict[str, dict] = {
    "services.*.kind": {"enum": ["Deployment", "StatefulSet"]},
    "monitoring.serviceMonitor.enabled": {"enum": [True, False, "auto"]},
    "monitoring.prometheusRule.enabled": {"enum": [True, False, "auto"]},
    "config.RAGLINE_AUTH_MODE": {"enum": ["off", "jwt"]},
    "config.RAGLINE_TLS_MODE": {"enum": ["off", "tls", "mtls"]},
    "image.digest": {"pattern": "^(sha256:[a-f0-9]{64})?$"},
    "tls.certManager.issuerRef.kind": {"enum": ["Issuer", "ClusterIssuer"]},
}


def matches(path: str, pattern: str) -> bool:
    parts, wanted = path.split("."), pattern.split(".")
    if len(parts) != len(wanted):
        return False
    return all(w in ("*", p) for p, w in zip(parts, wanted, strict=True))


def rule_for(path: str) -> dict | None:
    return next((rule for pattern, rule in RULES.items() if matches(path, pattern)), None)


def merged(base: dict, extra: dict) -> dict:
    """`base` with the keys only `extra` has (values-gpu.yaml's additions)."""
    out = dict(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out.setdefault(key, value)
    return out


def schema_of(value, path: str) -> dict:
    rule = rule_for(path)
    if rule is not None:
        return rule
    if any(matches(path, pattern) for pattern in OPEN):
        return {"type": "array"} if isinstance(value, list) else {}
    if isinstance(value, dict):
        return {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                key: schema_of(item, f"{path}.{key}" if path else key)
                for key, item in value.items()
            },
        }
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer", "minimum": 0}
    if isinstance(value, float):
        return {"type": "number", "minimum": 0}
    if isinstance(value, list):
        return {"type": "array"}
    if path.startswith("config."):
        # Environment values: a string, though `--set` may give a number or a boolean.
        return {"type": ["string", "number", "boolean"]}
    return {"type": "string"}


# Keys every service entry may carry that no default sets (the templates read them).
SERVICE_EXTRAS = {"nodeSelector": {"type": "object"}}


def build() -> dict:
    values = merged(
        yaml.safe_load((CHART / "values.yaml").read_text()),
        yaml.safe_load((CHART / "values-gpu.yaml").read_text()),
    )
    # One shape for every service entry: the union of the keys any of them sets, so that a
    # setting one service's defaults leave out (a cache size, a PDB kind) is still accepted.
    union: dict = {}
    for entry in values["services"].values():
        union = merged(union, entry)
    services = {name: merged(entry, union) for name, entry in values["services"].items()}
    schema = schema_of({**values, "services": services}, "")
    for entry in schema["properties"]["services"]["properties"].values():
        entry["properties"].update(SERVICE_EXTRAS)
    # Helm gives a subchart its parent's `global` values: the chart must accept the key to
    # be one (it reads nothing from it).
    schema["properties"]["global"] = {"type": "object"}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "ragline chart values (written by tools/make_values_schema.py)",
        **schema,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = json.dumps(build(), indent=1, sort_keys=False) + "\n"
    if args.check:
        if not SCHEMA.exists() or SCHEMA.read_text() != text:
            print(f"{SCHEMA} is stale: run tools/make_values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    print(SCHEMA)
    return 0


if __name__ == "__main__":
    sys.exit(main())
