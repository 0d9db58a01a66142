"""Child processes and loopback ports, handled the same way everywhere."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def dying_with_this_process(
    command: list[str], on_parent_death: signal.Signals = signal.SIGTERM
) -> list[str]:
    """`command` started so that it never outlives the process that starts it (an engine, a
    shard, a local server): the kernel sends it `on_parent_death` when its parent dies, even
    by SIGKILL (PR_SET_PDEATHSIG; Linux only, elsewhere `command` as it is).

    The kernel may send it more than once: each time the child is handed from a dying
    thread of its parent to another (a multi-threaded service killed outright: once or
    twice). A child that takes a second SIGTERM as "exit now" from inside its signal
    handler, as llama-server does (exit() there can hang in its destructors), is started
    with SIGKILL: once its parent is gone nobody reads what it would finish.

    The signal is armed by a small launcher that then execs `command` (it survives exec):
    never by a `preexec_fn`, which runs Python between fork and exec and can crash a child
    forked while gRPC threads run. The parent is the thread that forks: start such children
    from threads that live as long as the process (the event loop's, its executor's)."""
    if sys.platform != "linux":
        return command
    launcher = [sys.executable, "-m", "ragline.processes", str(os.getpid())]
    return [*launcher, str(int(on_parent_death)), *command]


def _exec_dying_with(parent: int, on_parent_death: int, command: list[str]) -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, on_parent_death)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(1)  # the parent died before the signal was armed
    os.execvp(command[0], command)


def terminate(process: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, bool]:
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


def wait_listening(
    process: subprocess.Popen[bytes], host: str, port: int, *, wait_s: float, name: str, log: Path
) -> None:
    """Returns once `process` accepts connections on host:port; RuntimeError (with the end
    of its log) when it exits first or does not listen within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on {host}:{port} within {wait_s} s")


if __name__ == "__main__":
    _exec_dying_with(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
