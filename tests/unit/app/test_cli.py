"""The `ragline` command's own flags."""

from __future__ import annotations

import pytest

import ragline
from ragline_app.cli import build_parser


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"ragline {ragline.__version__}"


def test_serve_knows_the_http_gateway():
    assert build_parser().parse_args(["serve", "gateway"]).service == "gateway"
