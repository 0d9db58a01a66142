"""Children that never outlive the process that starts them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ragline.processes import dying_with_this_process
from support.processes import all_gone, children


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b"ragline.processes"  # gone meanwhile: not one to wait for


def started_children(parent: int, marker: bytes) -> list[int]:
    """`parent`'s children whose command line holds `marker`, once exec'd (the launcher,
    `ragline.processes`, gone), waiting up to 10 s for them."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [
            pid
            for pid in children(parent, marker)
            if b"ragline.processes" not in _command_line(pid)
        ]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("the child did not start")


def test_a_child_started_dying_with_its_parent_goes_when_the_parent_is_killed(tmp_path):
    # A parent (a stand-in for a service) starts a long sleeper the kit's way, then is
    # killed outright; the sleeper must not stay behind.
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from ragline.processes import dying_with_this_process\n"
        "subprocess.Popen(dying_with_this_process(['sleep', '300']))\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)])
    sleepers = started_children(parent.pid, b"sleep\x00300")
    parent.kill()
    parent.wait()
    assert all_gone(sleepers, 5.0)


def test_elsewhere_the_command_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert dying_with_this_process(["sleep", "1"]) == ["sleep", "1"]


def test_a_child_armed_with_sigkill_goes_with_its_multithreaded_parent_whatever_it_handles(
    tmp_path,
):
    # llama-server handles SIGTERM (a first one: a graceful stop; a second: exit() from the
    # handler, which can hang), and a service has many threads: killed outright, the kernel
    # may signal its child once per thread the child is handed through. Armed as the
    # generation service arms its engine, a child that ignores SIGTERM must still go.
    child = tmp_path / "child.py"
    child.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, lambda *_: None)\ntime.sleep(300)\n"
    )
    script = tmp_path / "parent.py"
    script.write_text(
        "import signal, subprocess, sys, threading, time\n"
        "from ragline.processes import dying_with_this_process\n"
        "for _ in range(8):\n"
        "    threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n"
        "subprocess.Popen(dying_with_this_process(\n"
        f"    [sys.executable, {str(child)!r}], on_parent_death=signal.SIGKILL\n"
        "))\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)])
    found = started_children(parent.pid, b"child.py")
    time.sleep(0.5)  # its SIGTERM handler in place
    parent.kill()
    parent.wait()
    assert all_gone(found, 5.0), "a child that handles SIGTERM outlived its parent"
