"""The contract's gates: buf lint and buf breaking pass on proto/, and each fails on a
deliberately bad copy (so a change that breaks an existing client cannot land)."""

from __future__ import annotations

import re
import shutil

import pytest

from support import REPO_ROOT, load_tool

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def buf():
    tool = load_tool("buf")
    tool.ensure_buf()
    return tool


def test_the_contract_passes_lint_and_breaks_nothing(buf):
    linted = buf.lint()
    assert linted.returncode == 0, linted.stdout + linted.stderr
    compared = buf.breaking()
    assert compared.returncode == 0, compared.stdout + compared.stderr


def copy_of_proto(tmp_path):
    target = tmp_path / "proto"
    shutil.copytree(REPO_ROOT / "proto", target)
    return target / "ragline" / "v1"


def test_a_renumbered_field_fails_the_breaking_check(buf, tmp_path):
    v1 = copy_of_proto(tmp_path)
    path = v1 / "retrieval.proto"
    text = path.read_text()
    renumbered = re.sub(r"(string query = )1\b", r"\g<1>99", text, count=1)
    assert renumbered != text
    path.write_text(renumbered)
    compared = buf.breaking(v1.parent.parent, buf.BASELINE)
    assert compared.returncode != 0
    assert "query" in compared.stdout and "retrieval.proto" in compared.stdout


def test_a_removed_rpc_and_a_renamed_message_fail_the_breaking_check(buf, tmp_path):
    v1 = copy_of_proto(tmp_path)
    path = v1 / "rerank.proto"
    text = path.read_text()
    text = re.sub(r"\s*rpc Prepare\(PrepareRequest\) returns \(PrepareResponse\);", "", text)
    text = text.replace("message SkippedStage", "message StageSkipped").replace(
        "repeated SkippedStage", "repeated StageSkipped"
    )
    path.write_text(text)
    compared = buf.breaking(v1.parent.parent, buf.BASELINE)
    assert compared.returncode != 0
    assert "Prepare" in compared.stdout and "SkippedStage" in compared.stdout


def test_a_lint_violation_fails_the_lint_check(buf, tmp_path):
    v1 = copy_of_proto(tmp_path)
    path = v1 / "rerank.proto"
    path.write_text(path.read_text().replace("uint32 top_k = 3", "uint32 topK = 3"))
    linted = buf.lint(v1.parent.parent)
    assert linted.returncode != 0 and "topK" in linted.stdout
