"""A newcomer's first run, timed: a fresh clone of this repository's HEAD, empty pip and
ragline caches (a new HOME; the same pip configuration, so the same package registry), then
README's `make up BASE_PORT=0` and the first `ragline ask` answered. Prints the seconds to
serving and to the first answer, and the CPU they were measured on.

    .venv/bin/python tools/first_run.py [--prebuilt avx2] [--question "..."]

`--prebuilt avx2` runs it as a machine without AVX-512 would (the AVX2 engine; sets
RAGLINE_GENERATION_PREBUILT). Takes a few minutes and downloads every package again.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_LOADED = "ragline up: demo corpus"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def pip_config() -> dict[str, str]:
    """The pip configuration of this HOME, for the new one: the same registry."""
    if "PIP_CONFIG_FILE" in os.environ:
        return {"PIP_CONFIG_FILE": os.environ["PIP_CONFIG_FILE"]}
    mine = Path.home() / ".config" / "pip" / "pip.conf"
    return {"PIP_CONFIG_FILE": str(mine)} if mine.exists() else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prebuilt", default="", help="RAGLINE_GENERATION_PREBUILT")
    parser.add_argument("--question", default="Which river flows through Warsaw?")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ragline-first-run-") as folder:
        clone, home = Path(folder) / "ragline", Path(folder) / "home"
        home.mkdir()
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        env = {**os.environ, "HOME": str(home), **pip_config()}
        env.pop("XDG_CACHE_HOME", None)
        env.pop("RAGLINE_CACHE_DIR", None)
        env.pop("RAGLINE_MODEL_DIR", None)
        if args.prebuilt:
            env["RAGLINE_GENERATION_PREBUILT"] = args.prebuilt
        log = (Path(folder) / "make-up.log").open("w")
        started = time.monotonic()
        up = subprocess.Popen(
            ["make", "up", "BASE_PORT=0"], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        ragline = clone / ".venv" / "bin" / "ragline"
        serving = answered = None
        try:
            while time.monotonic() - started < args.timeout and up.poll() is None:
                time.sleep(2)
                if not ragline.exists():
                    continue
                if serving is None:
                    health = subprocess.run(
                        [str(ragline), "health"], cwd=clone, env=env, capture_output=True,
                        text=True,
                    )  # fmt: skip
                    if health.returncode == 0:
                        serving = time.monotonic() - started
                # README's question is about the demo corpus, which `ragline up` loads
                # once the services serve
                if serving is not None and DEMO_LOADED in Path(log.name).read_text():
                    break
            if serving is None or DEMO_LOADED not in Path(log.name).read_text():
                print(Path(log.name).read_text()[-3000:], file=sys.stderr)
                print("first_run: the stack did not come up", file=sys.stderr)
                return 1
            ask = subprocess.run(
                [str(ragline), "ask", args.question], cwd=clone, env=env, capture_output=True,
                text=True,
            )  # fmt: skip
            answered = time.monotonic() - started
            print(ask.stdout)
        finally:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        engine = args.prebuilt or "this CPU's"
        print(
            f"first run on {cpu_model()} ({os.cpu_count()} cores), prebuilt engine {engine}: "
            f"serving after {serving:.0f} s, first answer after {answered:.0f} s"
        )
        return 0 if ask.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
