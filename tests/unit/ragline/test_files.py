"""Durable files: what is fsynced before another file may point at it."""

from __future__ import annotations

import os

from ragline import files


def test_a_tree_is_fsynced_files_first_then_directories_bottom_up(tmp_path, monkeypatch):
    root = tmp_path / "shard"
    (root / "segments" / "0").mkdir(parents=True)
    (root / "point_ids.npy").write_bytes(b"ids")
    (root / "segments" / "0" / "data").write_bytes(b"vectors")
    synced = []
    monkeypatch.setattr(
        files.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
    )
    files.fsync_tree(root)
    expected_files = {str(root / "point_ids.npy"), str(root / "segments" / "0" / "data")}
    assert set(synced[:2]) == expected_files
    assert synced[2:] == [
        str(root / "segments" / "0"),
        str(root / "segments"),
        str(root),
        str(tmp_path),
    ]
