"""The embedding tools, where they can run without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import REPO_ROOT


def test_trt_engine_tool_explains_a_missing_tensorrt(tmp_path):

    pytest.importorskip("numpy")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    tool = REPO_ROOT / "tools" / "build_trt_engine.py"
    result = subprocess.run(
        [
            sys.executable,
            str(tool),
            "--onnx",
            str(tmp_path / "m.onnx"),
            "--out",
            str(tmp_path / "m.plan"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "needs TensorRT" in result.stderr and "GPU node" in result.stderr
