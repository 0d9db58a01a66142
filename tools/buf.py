"""buf lint and buf breaking for the ragline.v1 contract (proto/).

    .venv/bin/python tools/buf.py lint [--proto DIR]
    .venv/bin/python tools/buf.py breaking [--proto DIR] [--against IMAGE]
    .venv/bin/python tools/buf.py baseline        # only when a break is intended (a new v2)

The buf binary ships in the npm registry package @bufbuild/buf-<os>-<arch>; it is fetched
once (`npm pack`) into <cache dir>/buf/<version>/. `breaking` compares proto/ with the
committed image proto/ragline.v1.baseline.binpb (the contract as released): any change
that breaks wire, JSON or generated-code compatibility for an existing client fails. Adding
fields, messages, RPCs or enum values needs no new baseline.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

from ragline_app.npm_binaries import cached_binary

BUF_VERSION = "1.75.0"
REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto"
BASELINE = PROTO / "ragline.v1.baseline.binpb"


def _package() -> str:
    system = {"Linux": "linux", "Darwin": "darwin"}[platform.system()]
    machine = platform.machine().lower()
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "aarch64", "arm64": "arm64"}[machine]
    if system == "linux" and arch == "arm64":
        arch = "aarch64"
    return f"@bufbuild/buf-{system}-{arch}@{BUF_VERSION}"


def ensure_buf() -> Path:
    """The buf binary, fetched from the npm registry on first use."""
    return cached_binary("buf", BUF_VERSION, _package(), "bin/buf")


def run(*args: str | Path, proto: Path = PROTO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ensure_buf()), *(str(a) for a in args)],
        cwd=proto.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def lint(proto: Path = PROTO) -> subprocess.CompletedProcess:
    return run("lint", proto.name, proto=proto)


def breaking(proto: Path = PROTO, against: Path = BASELINE) -> subprocess.CompletedProcess:
    return run("breaking", proto.name, "--against", against, proto=proto)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("command", choices=["lint", "breaking", "baseline", "path"])
    parser.add_argument("--proto", type=Path, default=PROTO)
    parser.add_argument("--against", type=Path, default=BASELINE)
    args = parser.parse_args()
    if args.command == "path":
        print(ensure_buf())
        return 0
    if args.command == "baseline":
        result = run("build", args.proto.name, "--exclude-source-info", "-o", BASELINE,
                     proto=args.proto)  # fmt: skip
    elif args.command == "lint":
        result = lint(args.proto)
    else:
        result = breaking(args.proto, args.against.resolve())
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode == 0:
        print(f"buf {args.command}: ok", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
