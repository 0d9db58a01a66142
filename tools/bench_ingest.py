"""`ragline ingest` through running services: passages/s and where the CPU went.

    .venv/bin/python tools/bench_ingest.py [--data ../shared/data/squaddev_v1.1.json] \\
        [--runs 2] [--baseline DIR] [--env KEY=VALUE ...] [--variant NAME:KEY=VALUE,...]

Starts embedding, retrieval and rerank (`ragline serve`, free loopback ports, a fresh data
folder per run, each service's defaults) and runs the `ragline ingest` command a newcomer
runs, into an empty tenant. Reported per variant and run: wall seconds of the command,
passages/s, and the CPU seconds each service process (with its child processes) spent
meanwhile. Variants: this tree, `--baseline DIR` (another checkout, measured first) and
each `--variant NAME:KEY=VALUE,...` (this tree with those settings); `--env` applies to all.
Runs alternate between the variants, so a slow moment of a shared machine falls on all.

`--model-floor` first times the floor under all of that: the model that ingest runs once
per passage (rerank's token model, whose run gives the embedding too), loaded as rerank
loads it, running the same passages one text per run on as many threads at once as rerank
runs, in this process and with nothing else to do (no gRPC, batcher, store or index). The
ingest's wall seconds are then read against it: what the pipeline adds to the model.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragline_app.stack import source_pythonpath, spawn_service

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("embedding", "retrieval", "rerank")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        total += times.get(current, 0.0)
        stack.extend(children.get(current, []))
    return total


def one_run(label: str, env: dict[str, str], data: Path, scratch: Path) -> dict:
    work = scratch / label
    env = {**env, "RAGLINE_DATA_DIR": str(work / "data")}
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name in SERVICES:
            wiring = {f"RAGLINE_{other.upper()}_ADDR": started[other][1] for other in started}
            started[name] = spawn_service(name, {**env, **wiring}, work / f"{name}.log")
        addresses = {f"RAGLINE_{n.upper()}_ADDR": address for n, (_, address) in started.items()}
        before = {name: cpu_seconds(process.pid) for name, (process, _) in started.items()}
        clock = time.monotonic()
        command = [
            *(sys.executable, "-m", "ragline_app.cli", "ingest", str(data), "--tenant", "bench"),
            *("--quiet", "--restart", "--checkpoint", str(work / "checkpoint")),
        ]
        done = subprocess.run(
            command, env={**os.environ, **env, **addresses}, capture_output=True, text=True
        )
        wall = time.monotonic() - clock
        if done.returncode != 0:
            raise RuntimeError(f"{label}: ingest failed: {done.stderr[-2000:]}")
        used = {
            name: cpu_seconds(process.pid) - before[name] for name, (process, _) in started.items()
        }
        passages = int(done.stdout.split("ingested ", 1)[1].split()[0])
        return {"wall": wall, "passages": passages, "cpu": used, "said": done.stdout.strip()}
    finally:
        for process, _ in started.values():
            process.terminate()
        for process, _ in started.values():
            process.wait(timeout=60)


def model_floor(data: Path, env: dict[str, str]) -> dict:
    """Seconds for rerank's token model alone to run every passage of `data` (see above)."""
    from ragline.config import CommonConfig
    from ragline.cores import limit_blas_threads
    from ragline.models.store import ModelStore
    from ragline_app.ingest import Record, read_records
    from ragline_services.rerank.models import TokenEncoder
    from ragline_services.rerank.service import RerankConfig, build_reranker

    os.environ.update(env)
    limit_blas_threads(CommonConfig().blas_threads)  # as a service process does
    cfg = RerankConfig()
    texts = [r.text for r in read_records(data, "bench") if isinstance(r, Record)]

    async def timed() -> dict:
        # The service's own assembly: its model, tokenizer, prefix and number of runs.
        built = await build_reranker(cfg, ModelStore(cfg.model_dir or None))
        try:
            encoder = next(m for m in built.models if isinstance(m, TokenEncoder))
            reranker = built.reranker
            tokenized = reranker.token_tokenizer.encode(
                [reranker.passage_prefix + text for text in texts], refuse_over_limit=False
            )
            encoder.run_sync(tokenized[:1])  # the first run allocates what the others reuse
            clock = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(encoder.parallel_runs) as pool:
                list(pool.map(lambda text: encoder.run_sync([text]), tokenized))
            wall = time.monotonic() - clock
        finally:
            await built.close()
        tokens = sum(t.length for t in tokenized)
        return {
            "wall": wall,
            "passages": len(texts),
            "tokens": tokens,
            "runs": encoder.parallel_runs,
        }

    return asyncio.run(timed())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--data", type=Path, default=REPO / "app/ragline_app/data/squad_dev_sample.json"
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout, measured first")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE, every variant")
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,...")
    parser.add_argument(
        "--model-floor", action="store_true", help="time the model alone first (see above)"
    )
    args = parser.parse_args()
    common = dict(item.split("=", 1) for item in args.env)
    variants: list[tuple[str, dict[str, str]]] = []
    if args.baseline:
        variants.append(("before", {**common, "PYTHONPATH": source_pythonpath(args.baseline)}))
    variants.append(("after" if args.baseline else "this tree", common))
    for spec in args.variant:
        name, _, settings = spec.partition(":")
        variants.append((name, {**common, **dict(s.split("=", 1) for s in settings.split(","))}))
    floor = model_floor(args.data, common) if args.model_floor else None
    if floor:
        print(
            f"the model alone: {floor['passages']} passages ({floor['tokens']} tokens) in "
            f"{floor['wall']:.1f} s on {floor['runs']} runs at once",
            file=sys.stderr,
        )
    scratch = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    rows = []
    for run in range(args.runs):
        for name, env in variants:
            result = one_run(f"{name.replace(' ', '-')}-{run}", env, args.data, scratch)
            rows.append((name, run, result))
            print(f"{name} run {run}: {result['wall']:.1f} s; {result['said']}", file=sys.stderr)
    print(f"\n`ragline ingest {args.data.name}` into an empty tenant; CPU seconds per service")
    against = " | wall / the model alone" if floor else ""
    print(
        "| variant | run | passages | wall s | passages/s | "
        + " | ".join(SERVICES)
        + f"{against} |"
    )
    print("|---|---|---|---|---|" + "---|" * len(SERVICES) + ("---|" if floor else ""))
    if floor:
        rate = floor["passages"] / floor["wall"]
        no_cpu = " | ".join("" for _ in SERVICES)  # the model alone ran in this process
        print(
            f"| the model alone | | {floor['passages']} | {floor['wall']:.1f} | {rate:.1f} | "
            f"{no_cpu} | 1.00 |"
        )
    for name, run, r in rows:
        cpu = " | ".join(f"{r['cpu'][s]:.0f}" for s in SERVICES)
        rate = r["passages"] / r["wall"]
        ratio = f" | {r['wall'] / floor['wall']:.2f}" if floor else ""
        print(f"| {name} | {run} | {r['passages']} | {r['wall']:.1f} | {rate:.1f} | {cpu}{ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
