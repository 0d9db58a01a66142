"""Children that never outlive the process that starts them."""

from __future__ import annotations

import subprocess
import sys
import time

from ragline.processes import dying_with_this_process
from support.processes import all_gone, children


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
    deadline = time.monotonic() + 10
    sleepers: list[int] = []
    while not sleepers and time.monotonic() < deadline:
        sleepers = children(parent.pid, b"sleep\x00300")
        time.sleep(0.05)
    assert sleepers, "the child did not start"
    parent.kill()
    parent.wait()
    assert all_gone(sleepers, 5.0)


def test_elsewhere_the_command_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert dying_with_this_process(["sleep", "1"]) == ["sleep", "1"]
