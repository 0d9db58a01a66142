"""Stopping child processes the same way everywhere: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def terminate(process: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """Stops `process`; returns (exit code, whether it had to be killed)."""
    if process.poll() is not None:
        return process.returncode, False
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(), True
