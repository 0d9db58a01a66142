"""What TLS costs an Ask, in one run against plaintext (issue 39's goal: `Ask` p50 at
concurrency 1 within 5% of plaintext).

    .venv/bin/python tools/bench_tls.py [--data ../shared/data/squaddev_v1.1.json] \\
        [--passages 100] [--asks 40] [--variants off,mtls]

A stack per variant (`ragline up --base-port 0`, `--tls <mode>` for tls / mtls, a data
folder each, the same passages ingested by `ragline ingest`, which finds each stack's
address and client certificate in its data folder). Then each question is asked of every
variant in turn, one at a time (caches bypassed; the first variant alternating), so a
slow moment of a shared machine and a question's own time (its answer's length) fall on
all. Printed: the p50 of each, the ratio to `off`, and the median of each question's
difference from `off`. `off-again` is a second plaintext stack: the noise floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragline.tls import TlsConfig
from ragline_app.benchmarks import ask_pairs, start_stack
from ragline_app.datasets import load_squad, write_jsonl
from ragline_app.eval_data import eval_file

TENANT = "bench-tls"
MODES = {"off": None, "off-again": None, "tls": "tls", "mtls": "mtls"}


def client_tls(workdir: Path) -> TlsConfig:
    """The client settings the stack recorded (`ragline up --tls` writes them)."""
    recorded = json.loads((workdir / "up.json").read_text()).get("tls") or {}
    settings = {k.removeprefix("RAGLINE_TLS_").lower(): v for k, v in recorded.items()}
    return TlsConfig(**settings) if settings else TlsConfig(mode="off")


def ingest(data: Path, workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGLINE_TLS_")}
    env["RAGLINE_DATA_DIR"] = str(workdir)
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "ragline_app.cli", "ingest", str(data), "--tenant", TENANT],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"  ingested in {time.monotonic() - started:.0f} s", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=eval_file("squaddev_v1.1.json"))
    parser.add_argument("--passages", type=int, default=100)
    parser.add_argument("--asks", type=int, default=40)
    parser.add_argument("--variants", default="off,mtls", help=f"of {', '.join(MODES)}")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if variants[0] != "off" or set(variants) - set(MODES):
        parser.error(f"--variants starts with off, of {', '.join(MODES)}")

    passages, questions = load_squad(args.data)
    chosen = passages[: args.passages]
    kept = {p.id for p in chosen}
    asked = [q.text for q in questions if q.passage_id in kept]
    random.Random(7).shuffle(asked)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-tls-"))
    data = write_jsonl(chosen, workdir / "passages.jsonl")
    stacks, processes = {}, []
    try:
        for name in variants:
            mode = MODES[name]
            # Generation sizes its slots from the memory free at start: fixed, so that a
            # stack started later is not given fewer or shorter slots.
            env = {"RAGLINE_GENERATION_MEMORY_BUDGET_MB": "3072"}
            up_args = ["--no-metrics", *(["--tls", mode] if mode else [])]
            process, addresses = start_stack(workdir / name, env, up_args=up_args)
            processes.append(process)
            ingest(data, workdir / name)
            stacks[name] = (addresses["orchestrator"], client_tls(workdir / name))
            print(f"{name}: started ({stacks[name][1].mode})", file=sys.stderr)
            asyncio.run(ask_pairs({name: stacks[name]}, asked[:3], TENANT))  # warm-up
        paired = asyncio.run(ask_pairs(stacks, asked[3 : 3 + args.asks], TENANT))
    finally:
        for process in processes:
            process.send_signal(2)
        for process in processes:
            process.wait(timeout=60)
    p50 = {n: statistics.median(v) for n, v in paired.items()}
    added = {
        n: statistics.median(b - a for a, b in zip(paired["off"], paired[n], strict=True))
        for n in paired
    }
    names = [n for n in variants if n != "off"]
    print("| measure | off | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    print(
        f"| Ask, c=1, p50 (ms) | {p50['off'] * 1000:.0f} | "
        + " | ".join(f"{p50[n] * 1000:.0f} ({p50[n] / p50['off']:.3f})" for n in names)
        + " |"
    )
    print(
        "| Ask, c=1, median of each question's difference (ms) | 0 | "
        + " | ".join(f"{added[n] * 1000:+.2f}" for n in names)
        + " |"
    )
    if args.json:
        args.json.write_text(json.dumps({"ask_s": paired, "p50_s": p50, "added_s": added}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
