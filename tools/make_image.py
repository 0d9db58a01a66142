"""Build the ragline image from packages alone: a base image made from Debian's packages
with debootstrap (no image registry is reachable or needed), then the repository's
Dockerfile on it, tagged ragline:<version>.

    .venv/bin/python tools/make_image.py [--tag ragline:0.3.0] [--mirror URL] [--base-only]

`make image` runs it (and installs Debian's docker.io and debootstrap first). It needs
root for debootstrap, and a Docker engine: where none answers, it starts Debian's dockerd
with host networking only (`--bridge=none --iptables=false`: containers run with
`--network host`, so everything stays on the machine's own addresses). The base is built
once per package list; the Dockerfile's stages are cached by Docker, so a change of the
code rebuilds only the last stages. Prints the tag, the size and the seconds taken last.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Everything the image needs beyond a minimal Debian: Python 3.11 and its venv module, and
# the libraries the prebuilt llama-server loads beside glibc (OpenMP, the C++ runtime).
# tests/deploy/test_image.py checks this list against what the engine links.
BASE_PACKAGES = ("python3", "python3-venv", "libgomp1", "libstdc++6", "ca-certificates")
ENGINE_START_S = 60.0


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def docker_client() -> str:
    """Debian's client builds with BuildKit built in; a newer client needs the buildx
    plugin for the same (`RUN --mount` in the Dockerfile)."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and Path(candidate).exists():
            return candidate
    raise SystemExit("make_image: no docker client (Debian: apt-get install docker.io)")


def engine_answers(client: str) -> bool:
    probe = subprocess.run([client, "info"], capture_output=True, timeout=30)
    return probe.returncode == 0


def ensure_engine(client: str, log_path: Path) -> None:
    if engine_answers(client):
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        raise SystemExit(
            "make_image: no Docker engine answers, and none can be started here "
            "(dockerd needs root: apt-get install docker.io)"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        subprocess.Popen(
            [dockerd, "--bridge=none", "--iptables=false", "--ip6tables=false"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives this tool: the tests and later builds use it
        )
    deadline = time.monotonic() + ENGINE_START_S
    while time.monotonic() < deadline:
        if engine_answers(client):
            print(f"make_image: started dockerd (log: {log_path})", flush=True)
            return
        time.sleep(1)
    raise SystemExit(f"make_image: dockerd did not answer in {ENGINE_START_S:.0f} s: {log_path}")


def image_exists(client: str, tag: str) -> bool:
    found = subprocess.run([client, "image", "inspect", tag], capture_output=True)
    return found.returncode == 0


def base_tag() -> str:
    """Named by what it holds, so a changed package list builds a new base."""
    digest = hashlib.sha256(" ".join((SUITE, *BASE_PACKAGES)).encode()).hexdigest()[:12]
    return f"ragline-base:{SUITE}-{digest}"


def make_base(client: str, tag: str, mirror: str) -> None:
    if image_exists(client, tag):
        print(f"make_image: base {tag} is built", flush=True)
        return
    if shutil.which("debootstrap") is None:
        raise SystemExit("make_image: debootstrap is missing (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="ragline-base-") as work:
        root = Path(work) / "root"
        run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             SUITE, str(root), mirror],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        # Package lists and downloaded .debs are of no use in the image.
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        run(
            [client, "import", "--change", "ENV LANG=C.UTF-8", "--change",
             'CMD ["/bin/bash"]', "-", tag],
            stdin=tar.stdout,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        if tar.wait() != 0:
            raise SystemExit("make_image: tar of the base's root failed")


def ca_bundle() -> Path | None:
    """The CA bundle pip trusts here (a proxy's CA included): handed to the build as a
    secret, so the build downloads as this machine does and no layer keeps it."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.cert"],
        capture_output=True,
        text=True,
    )
    if configured.returncode == 0 and configured.stdout.strip():
        return Path(configured.stdout.strip())
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    return system if system.exists() else None


def version() -> str:
    with (REPO_ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)["project"]["version"]


def build(client: str, base: str, tag: str) -> None:
    command = [client, "build", "--network", "host", "--progress", "plain",
               "--build-arg", f"BASE_IMAGE={base}", "-t", tag]  # fmt: skip
    bundle = ca_bundle()
    if bundle is not None:
        command += ["--secret", f"id=pip_ca,src={bundle}"]
    run([*command, str(REPO_ROOT)], env={**os.environ, "DOCKER_BUILDKIT": "1"})


def image_size_mb(client: str, tag: str) -> float:
    size = run([client, "image", "inspect", "-f", "{{.Size}}", tag], capture_output=True, text=True)
    return int(size.stdout.strip()) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=f"ragline:{version()}")
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="the Debian mirror")
    parser.add_argument("--base-only", action="store_true")
    parser.add_argument(
        "--skip-without-engine",
        action="store_true",
        help="where no Docker engine can run (no root, no dockerd), say so and exit 0 "
        "(the image test then skips, naming why); a failing build still fails",
    )
    args = parser.parse_args()

    started = time.monotonic()
    try:
        client = docker_client()
        ensure_engine(client, Path.home() / ".cache" / "ragline" / "dockerd.log")
    except SystemExit as no_engine:
        if not args.skip_without_engine:
            raise
        print(f"{no_engine}: no image built", file=sys.stderr)
        return 0
    base = base_tag()
    make_base(client, base, args.mirror)
    if args.base_only:
        print(base)
        return 0
    build(client, base, args.tag)
    print(
        f"make_image: {args.tag} on {base}: {image_size_mb(client, args.tag):.0f} MB, "
        f"{time.monotonic() - started:.0f} s"
    )
    print(args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
