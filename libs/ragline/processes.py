"""Child processes and loopback ports, handled the same way everywhere."""

from __future__ import annotations

import signal
import socket
import subprocess


def terminate(process: subprocess.Popen, timeout_s: float) -> tuple[int, bool]:
    """Stops `process`: SIGTERM, a grace period, then SIGKILL. Returns (exit code, killed).

    Blocks for up to `timeout_s`: call it from a worker thread inside an event loop."""
    if process.poll() is not None:
        return process.returncode, False
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(), True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the kernel reports free right now (all held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
