"""README's first command, as a newcomer types it: `make up BASE_PORT=0` (README's form
for free ports), then `ragline ask`, then every other shell block of README as printed.

It runs the default model (Qwen2.5-Coder-0.5B) on the demo corpus that `make up` ingests
on first start, and expects the right answer with the right source.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ragline_services.registry import default_address, http_service_names, service_names
from support import REPO_ROOT
from support.readme import ShellBlock, run_block, shell_blocks

pytestmark = pytest.mark.e2e

RAGLINE = Path(sys.executable).parent / "ragline"
README = REPO_ROOT / "README.md"
# README's blocks that this test does not run, by how the block starts, and why.
NOT_RUN_HERE = {
    "make up": "this test runs it, in README's form for free ports (`make up BASE_PORT=0`)",
    "make test": "CI runs it (.ci/run)",
    "make image": "the full tier builds it (`make test-full`) and runs the stack from it "
    "(tests/e2e/test_image_stack.py); no registry or cluster here to push to",
    "export RAGLINE_AUTH_JWT_KEY=...": "its key is a placeholder for the reader's own, and "
    "the stack `make up` starts has authentication off",
}


def runnable(block: ShellBlock) -> bool:
    return not any(block.text.startswith(start) for start in NOT_RUN_HERE)


def on_this_stack(block: ShellBlock, data_dir: Path) -> ShellBlock:
    """The block with README's default addresses replaced by where `make up` put each
    service (up.json), since the test runs on free ports."""
    state = json.loads((data_dir / "up.json").read_text())["services"]
    moved = ShellBlock(block.line, _moved(block.text, state))
    moved.commands = [replace(c, text=_moved(c.text, state)) for c in block.commands]
    return moved


def _moved(text: str, state: dict) -> str:
    for name in [*service_names(), *http_service_names()]:
        text = text.replace(default_address(name), state[name]["address"])
    return text


def test_readme_names_only_blocks_it_has_in_its_not_run_list():
    starts = [block.text for block in shell_blocks(README)]
    for start in NOT_RUN_HERE:
        assert any(text.startswith(start) for text in starts), f"no README block starts {start!r}"


def test_make_up_then_ragline_ask_answers_with_a_citation(tmp_path):
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "RAGLINE_DATA_DIR": str(tmp_path / "data"),
    }
    up = subprocess.Popen(
        # README's variant for a machine whose default ports are taken (CI's may be).
        ["make", "up", "BASE_PORT=0"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # Ctrl-C reaches make and everything it started
    )
    output: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line and up.poll() is not None:
                break
            output.append(line)
            if "ragline up: ready" in line:
                break
        assert any("ragline up: ready" in line for line in output), "".join(output)
        assert any("demo corpus: 203 passages ingested" in line for line in output), output
        asked = subprocess.run(
            [str(RAGLINE), "ask", "Which river flows through Warsaw?"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert asked.returncode == 0, asked.stdout + asked.stderr
        answer, _, rest = asked.stdout.partition("\n[")
        assert "vistula" in answer.lower(), asked.stdout
        assert "sources:" in rest and "Warsaw (squad_dev_sample:0:" in rest, asked.stdout

        # Every other block of README, as printed (grpcurl from the virtualenv's bin, as
        # README says), each command exiting 0 or with the status README names for it.
        shell_env = {**env, "PATH": f"{RAGLINE.parent}{os.pathsep}{env['PATH']}"}
        failures = []
        for block in filter(runnable, shell_blocks(README)):
            moved = on_this_stack(block, tmp_path / "data")
            for outcome in run_block(moved, cwd=REPO_ROOT, env=shell_env, timeout_s=300):
                if outcome.failure:
                    failures.append(f"{outcome.failure}: {outcome.describe()}")
        assert not failures, "\n\n".join(failures)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            tail, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            tail, _ = up.communicate()
    assert "all services stopped cleanly" in tail, "".join(output) + tail
