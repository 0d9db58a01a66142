"""Benchmark of the budget ledger against a real etcd and real budget-service processes.

    .venv/bin/python tools/bench_budget.py [--seconds 5] [--replicas 1] [--levels 1,8,64]

For each concurrency level it spreads the workers over up to 4 client processes; each worker
loops Reserve -> Settle. Two task layouts: every worker on one shared task (contention:
guarded transactions conflict and retry) and one task per worker (no contention). Reports
reserve+settle pairs per second, the latency of a pair (p50/p99 over every pair, failed
ones included), the conflict-retry rate (extra ledger transactions per call) and, with
several replicas, each replica's share of the pairs (its clients are a fair share of the
workers, so a share far below 1/replicas means it starves).

`--baseline DIR` (another checkout) runs every row twice in one run, first with the
budget service from DIR's code, then from this tree's, for before / after ratios.

`--clients unary,batched` (the default) measures each row with both clients in one run:
`unary` sends every Reserve and Settle as its own call (what any gRPC client does);
`batched` goes through the kit's `BudgetCallBatcher` (what `TaskBudget` uses), which sends
the calls a client process makes at the same moment as one `Batch` call. The row shows the
mean items per Batch call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from ragline.budget_batch import BudgetCallBatcher
from ragline.clients import ChannelPool, ServiceClient
from ragline.identity import Caller
from ragline.v1 import budget_pb2, budget_pb2_grpc, common_pb2
from ragline_app.etcd_server import EtcdServer
from ragline_app.stack import free_ports, source_pythonpath, spawn_service

LIMITS = common_pb2.BudgetAmounts(input_tokens=10**12, output_tokens=10**12, calls=10**12)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def open_task(stub, metadata, task_id: str) -> None:
    request = budget_pb2.OpenTaskRequest(task_id=task_id, limits=LIMITS)
    request.timeout.FromSeconds(3600)
    await stub.OpenTask(request, timeout=10, metadata=metadata)


async def run_worker_process(args) -> None:
    """One client process: `--workers` loops for `--seconds`; prints JSON results."""
    metadata = (("x-ragline-tenant", args.tenant),)
    latencies: list[float] = []
    attempts: list[int] = []
    failures: dict[str, int] = {}
    pool = ChannelPool()
    client = ServiceClient(
        budget_pb2_grpc.BudgetServiceStub, args.address, pool=pool, caller=Caller(args.tenant)
    )
    batcher = BudgetCallBatcher(client)

    def call(method: str):
        if args.client == "batched":
            return lambda request, **_: batcher.call(method, request)
        return getattr(stub, method)

    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = budget_pb2_grpc.BudgetServiceStub(channel)
        reserve, settle = call("Reserve"), call("Settle")

        async def worker(index: int) -> None:
            task_id = args.task or f"{args.prefix}-{index}"
            if not args.task:
                await open_task(stub, metadata, task_id)
            end = time.monotonic() + args.seconds
            n = 0
            while time.monotonic() < end:
                n += 1
                rid = f"{args.prefix}-{index}-{n}"
                started = time.perf_counter()
                try:
                    reserved = await reserve(
                        budget_pb2.ReserveRequest(
                            task_id=task_id,
                            reservation_id=rid,
                            amounts=common_pb2.BudgetAmounts(output_tokens=10, calls=1),
                        ),
                        timeout=10,
                        metadata=metadata,
                    )
                    settled = await settle(
                        budget_pb2.SettleRequest(
                            task_id=task_id,
                            reservation_id=rid,
                            actual=common_pb2.BudgetAmounts(output_tokens=7, calls=1),
                        ),
                        timeout=10,
                        metadata=metadata,
                    )
                    attempts.extend((reserved.attempts, settled.attempts))
                except grpc.aio.AioRpcError as error:
                    key = f"{error.code().name}: {error.details()[:80]}"
                    failures[key] = failures.get(key, 0) + 1
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(worker(i) for i in range(args.workers)))
    await pool.close()
    result = {"latencies": latencies, "attempts": attempts, "failures": failures}
    result.update(batches=batcher.batches_sent, batched_items=batcher.items_sent)
    print(json.dumps(result))


def run_level(addresses, workers: int, seconds: float, shared: bool, client: str) -> dict:
    processes = min(workers, 4)
    per_process = [
        workers // processes + (1 if i < workers % processes else 0) for i in range(processes)
    ]
    tenant = f"bench-{uuid.uuid4().hex[:8]}"
    task = f"shared-{uuid.uuid4().hex[:8]}" if shared else ""
    if shared:

        async def open_shared():
            async with grpc.aio.insecure_channel(addresses[0]) as channel:
                await open_task(
                    budget_pb2_grpc.BudgetServiceStub(channel),
                    (("x-ragline-tenant", tenant),),
                    task,
                )

        asyncio.run(open_shared())
    started = time.monotonic()
    children = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--address",
                addresses[i % len(addresses)],
                "--tenant",
                tenant,
                "--task",
                task,
                "--prefix",
                f"p{i}",
                "--workers",
                str(count),
                "--seconds",
                str(seconds),
                "--client",
                client,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, count in enumerate(per_process)
    ]
    results = [json.loads(child.communicate()[0]) for child in children]
    wall = time.monotonic() - started
    by_replica = [0] * len(addresses)
    for i, result in enumerate(results):
        by_replica[i % len(addresses)] += len(result["latencies"])
    latencies = [x for r in results for x in r["latencies"]]
    attempts = [x for r in results for x in r["attempts"]]
    calls = max(len(attempts), 1)
    batches = sum(r["batches"] for r in results)
    return {
        "client": client,
        "items_per_batch": sum(r["batched_items"] for r in results) / batches if batches else 0,
        "workers": workers,
        "processes": processes,
        "layout": "shared task" if shared else "task per worker",
        "pairs": len(latencies),
        "pairs_per_s": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "conflict_retries_per_call": (sum(attempts) - len(attempts)) / calls,
        "failures": sum(sum(r["failures"].values()) for r in results),
        "failure_kinds": sorted({k for r in results for k in r["failures"]}),
        "replica_shares": [n / max(sum(by_replica), 1) for n in by_replica],
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--levels", default="1,8,64")
    parser.add_argument("--replicas", type=int, default=1, help="budget-service processes")
    parser.add_argument(
        "--unsafe-no-fsync",
        action="store_true",
        help="etcd without fsync (as in the tests); default keeps fsync on",
    )
    parser.add_argument(
        "--clients",
        default="unary,batched",
        help="which clients to measure each row with (unary: a call per request; batched: "
        "the kit's BudgetCallBatcher)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured first")
    # internal: one client process
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--tenant", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", default="unary", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(run_worker_process(args))
        return 0

    clients = args.clients.split(",")
    variants = []
    if args.baseline:
        # A baseline without Batch is measured with the unary client only (its code, run
        # beside this tree's stubs, would answer Batch INTERNAL, not UNIMPLEMENTED).
        servicer = (args.baseline / "services/ragline_services/budget/servicer.py").read_text()
        old_clients = clients if "def Batch" in servicer else ["unary"]
        variants.append(("before", source_pythonpath(args.baseline), old_clients))
    variants.append(("after" if args.baseline else "", None, clients))
    rows = []
    for name, pythonpath, variant_clients in variants:
        for row in run_variant(args, pythonpath, variant_clients):
            rows.append({"variant": name, **row})
    print(
        f"budget ledger, {args.replicas} service replica(s), etcd fsync "
        f"{'off' if args.unsafe_no_fsync else 'on'}, {args.seconds:.0f} s per row"
    )
    print(
        "| code | client (items per Batch) | workers (processes) | layout "
        "| reserve+settle pairs/s | p50 ms | p99 ms | p99 / p50 | conflict retries per call "
        "| replica shares | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        shares = " / ".join(f"{share:.0%}" for share in row["replica_shares"])
        client = row["client"]
        if row["items_per_batch"]:
            client += f" ({row['items_per_batch']:.1f})"
        print(
            f"| {row['variant'] or 'this tree'} | {client} | "
            f"{row['workers']} ({row['processes']}) | {row['layout']} | "
            f"{row['pairs_per_s']:.0f} | {row['p50_ms']:.1f} | "
            f"{row['p99_ms']:.1f} | {row['p99_ms'] / max(row['p50_ms'], 1e-9):.1f} | "
            f"{row['conflict_retries_per_call']:.2f} | {shares} | {row['failures']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def run_variant(args, pythonpath: str | None, clients: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        tmp_path = Path(tmp)
        client_port, peer_port = free_ports(2)
        etcd = EtcdServer(
            tmp_path / "etcd", client_port, peer_port, unsafe_no_fsync=args.unsafe_no_fsync
        )
        etcd.start()
        services = []
        try:
            env = {"RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint, "RAGLINE_LOG_LEVEL": "warning"}
            if pythonpath:
                env["PYTHONPATH"] = pythonpath
            addresses = []
            for replica in range(args.replicas):
                process, address = spawn_service(
                    "budget", env, tmp_path / f"budget-{replica}.log", wait_s=60
                )
                services.append(process)
                addresses.append(address)
            rows = []
            for level in (int(x) for x in args.levels.split(",")):
                for shared in (True, False):
                    for client in clients:
                        rows.append(run_level(addresses, level, args.seconds, shared, client))
                        print(json.dumps(rows[-1]), file=sys.stderr)
            return rows
        finally:
            for service in services:
                service.terminate()
                service.wait()
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
