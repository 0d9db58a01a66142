"""README's first command, as a newcomer types it: `make up BASE_PORT=0` (README's form
for free ports), then `ragline ask`.

It runs the default model (Qwen2.5-Coder-0.5B) on the demo corpus that `make up` ingests
on first start, and expects the right answer with the right source.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO_ROOT

pytestmark = pytest.mark.e2e

RAGLINE = Path(sys.executable).parent / "ragline"


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
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            tail, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            tail, _ = up.communicate()
    assert "all services stopped cleanly" in tail, "".join(output) + tail
