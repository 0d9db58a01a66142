"""Open-loop `Ask` load past saturation: does the stack keep its goodput, and does a flooding
tenant leave a quiet one its share?

    .venv/bin/python tools/loadgen.py --load 0.5,1,2,3 --seconds 60 --plot load.png

Starts the stack (`ragline up --base-port 0 --no-demo`, data in --workdir) unless --addr
points at a running orchestrator, and ingests the demo corpus (five SQuAD articles) into
every tenant it asks as, once. Then:
1. capacity: `--max-in-flight` closed-loop workers of tenant `flood` for --seconds/2: the
   COMPLETE answers per second the stack sustains (its capacity);
2. for each load (a multiple of the capacity), --rounds rounds of two blocks, each
   --seconds/--rounds long: the quiet tenant alone, one question at a time (its unloaded
   latency), then the flood tenant asking open loop (Poisson arrivals at load x capacity,
   each with its own deadline, never waiting for the one before) while the quiet tenant
   keeps asking one question at a time. A block ends when its asks in flight have, then
   the stack idles for BETWEEN_BLOCKS_S.

Every ask has --deadline and bypasses the caches. Reported per phase and tenant, over
every ask offered (none dropped): COMPLETE within the deadline (goodput, per second and
as a share of what was offered), refused at once (RESOURCE_EXHAUSTED, with how long the
refusal took), cut at the deadline (PARTIAL deadline), DEADLINE_EXCEEDED, other outcomes,
and latency p50/p95/p99 of the answered. Goodput is compared with the unloaded capacity,
the quiet tenant's p95 with its unloaded p95 over the same questions in the same stretch
of time: the alone and the loaded blocks alternate, so the two see the same machine (a
shared machine's speed drifts by a quarter between runs minutes apart); the quiet tenant
asks the same sequence in both (answers differ in length, and the p95 of a few dozen
questions drawn at random moves with which came up), each as a tenant of its own with the
same documents (`quiet-2x-alone`, `quiet-2x`, ...: neither finds the engine's caches warm
with the other's prompts), and the loaded p95 is compared with that of the same first
questions asked alone. Then where the quiet tenant's time went, per phase (mean seconds
of its answered asks: admission, each plan node, and the generation service's queue,
prefill, decode and paused time).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from ragline import deadlines, identity
from ragline.clients import ChannelPool, ServiceClient
from ragline.logs import configure_logging
from ragline.retry import retry_delay_of
from ragline.timing import seconds_of
from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from ragline_app.benchmarks import ensure_ingested, start_stack
from ragline_app.datasets import load_squad
from ragline_app.ingest import DEMO_CORPUS

REPO = Path(__file__).resolve().parents[1]
TENANTS = ("flood", "quiet")
# Idle between blocks: longer than the front door's activity window (5 s), so the tenant of
# one block is not still an active tenant asking often in the next (in the loaded block that
# made the flood's first run the light one, ahead of the quiet tenant).
BETWEEN_BLOCKS_S = 6.0


@dataclass
class Ask:
    tenant: str
    phase: str
    offered_at: float
    seconds: float = 0.0
    state: str = ""  # COMPLETE | PARTIAL | INCOMPLETE, or the status code's name
    reason: str = ""
    question: str = ""
    retry_after_s: float = 0.0  # a refusal's RetryInfo delay
    # Where an answered ask's time went (timing report): admission, each node's span, and
    # the generation service's own stages (queue, prefill, decode, paused).
    spent: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.state == "COMPLETE"


def time_spent(report: orchestrator_pb2.TimingReport) -> dict[str, float]:
    spent = {"admission": seconds_of(report.admission_wait)}
    for node in report.nodes:
        if node.HasField("finished") and node.HasField("began"):
            spent[node.node_id] = seconds_of(node.finished) - seconds_of(node.began)
        if node.kind == orchestrator_pb2.NODE_KIND_GENERATE and node.HasField("server"):
            spent["generation queue"] = seconds_of(node.server.queue_wait)
            for stage in node.server.stages:
                spent[f"generation {stage.name}"] = seconds_of(stage.duration)
    return spent


def breakdown(asks: list[dict], tenant: str, phases: list[str]) -> str:
    """Mean seconds per part of `tenant`'s answered asks, per phase: where a flood's time
    goes into a quiet tenant's answers."""
    means: dict[str, dict[str, float]] = {}
    for phase in phases:
        spent = [a["spent"] for a in asks if a["tenant"] == tenant and a["phase"] == phase]
        spent = [x for x in spent if x]
        parts = sorted({k for x in spent for k in x})
        means[phase] = {k: float(np.mean([x.get(k, 0.0) for x in spent])) for k in parts}
    parts = list(dict.fromkeys(k for phase in phases for k in means[phase]))
    lines = [
        f"{tenant} tenant, mean seconds per answered ask:",
        "| part | " + " | ".join(phases) + " |",
        "|---|" + "---|" * len(phases),
    ]
    for part in parts:
        cells = " | ".join(f"{means[p].get(part, 0.0):.3f}" for p in phases)
        lines.append(f"| {part} | {cells} |")
    return "\n".join(lines)


def quiet_tenant(phase: str) -> str:
    """The quiet tenant of a phase: one of its own per measured phase (see the module)."""
    return "quiet" if phase == "warm-up" else "quiet-" + phase.replace(" ", "-")


class Asker:
    def __init__(
        self, address: str, questions: list[str], deadline_s: float, tenants: list[str]
    ) -> None:
        self.pool = ChannelPool()
        self.clients = {
            tenant: ServiceClient(
                orchestrator_pb2_grpc.OrchestratorServiceStub,
                address,
                pool=self.pool,
                caller=identity.Caller(tenant),
            )
            for tenant in tenants
        }
        self.questions = questions
        self.deadline_s = deadline_s
        self.rng = random.Random(5)
        # The quiet tenant's questions: the same sequence from the start of every phase.
        self.sequences: dict[str, random.Random] = {}
        self.arrivals: dict[str, random.Random] = {}  # the flood's, per phase
        self.asks: list[Ask] = []

    def _question(self, tenant: str, phase: str) -> str:
        if tenant != "quiet":
            return self.rng.choice(self.questions)
        return self.sequences.setdefault(phase, random.Random(7)).choice(self.questions)

    async def ask(self, tenant: str, phase: str) -> Ask:
        record = Ask(tenant, phase, time.monotonic(), question=self._question(tenant, phase))
        self.asks.append(record)
        request = orchestrator_pb2.AskRequest(
            question=record.question, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
        )
        client = self.clients[quiet_tenant(phase) if tenant == "quiet" else tenant]
        try:
            with deadlines.deadline_scope(self.deadline_s):
                async for message in client.stream("Ask", request):
                    if message.WhichOneof("event") == "result":
                        status = message.result.status
                        record.state = common_pb2.AnswerState.Name(status.state)[13:]
                        record.reason = status.reason
                        record.spent = time_spent(message.result.timing)
        except grpc.aio.AioRpcError as error:
            record.state = error.code().name
            record.retry_after_s = retry_delay_of(error) or 0.0
        except Exception as error:  # a deadline the client itself enforced
            record.state = type(error).__name__
        record.seconds = time.monotonic() - record.offered_at
        return record

    async def closed_loop(self, tenant: str, phase: str, workers: int, seconds: float) -> None:
        stop = time.monotonic() + seconds

        async def worker():
            # A well-behaved client: after a refusal it waits what RetryInfo says.
            while time.monotonic() < stop:
                record = await self.ask(tenant, phase)
                await asyncio.sleep(min(record.retry_after_s, max(stop - time.monotonic(), 0)))

        await asyncio.gather(*(worker() for _ in range(workers)))

    async def open_loop(self, tenant: str, phase: str, rate: float, seconds: float) -> None:
        stop = time.monotonic() + seconds
        rng = self.arrivals.setdefault(phase, random.Random(11))
        running = set()
        while time.monotonic() < stop:
            task = asyncio.ensure_future(self.ask(tenant, phase))
            running.add(task)
            task.add_done_callback(running.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*running)


def summary(asks: list[Ask], seconds: float) -> dict:
    n = max(len(asks), 1)
    states = collections.Counter(a.state for a in asks)
    answered = [a.seconds for a in asks if a.state in ("COMPLETE", "PARTIAL", "INCOMPLETE")]
    refused = [a.seconds for a in asks if a.state == "RESOURCE_EXHAUSTED"]
    p = np.percentile(answered, [50, 95, 99]) if answered else [float("nan")] * 3
    return {
        "offered": len(asks),
        "complete": states["COMPLETE"],
        "goodput_per_s": states["COMPLETE"] / seconds,
        "goodput_share": states["COMPLETE"] / n,
        "refused": len(refused),
        "refusal_p95_s": float(np.percentile(refused, 95)) if refused else float("nan"),
        "cut_at_deadline": sum(a.state == "PARTIAL" and a.reason == "deadline" for a in asks),
        "deadline_exceeded": states["DEADLINE_EXCEEDED"],
        "other": {
            k: v
            for k, v in states.items()
            if k not in ("COMPLETE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
        },
        "p50": float(p[0]),
        "p95": float(p[1]),
        "p99": float(p[2]),
    }


async def measure(address: str, questions: list[str], args) -> dict:
    asker = Asker(address, questions, args.deadline, tenants(args))
    half = args.seconds / 2
    # Warm-up: every slot and cache path sees traffic once; not measured.
    await asker.closed_loop("flood", "warm-up", args.max_in_flight, 10)
    await asker.closed_loop("quiet", "warm-up", 1, 5)
    results: dict[str, dict] = {}
    await asker.closed_loop("flood", "capacity", args.max_in_flight, half)
    capacity = summary([a for a in asker.asks if a.phase == "capacity"], half)
    results["capacity"] = {"flood": capacity}
    rate = capacity["goodput_per_s"]
    print(f"capacity: {rate:.2f} COMPLETE answers/s", file=sys.stderr)
    offered_rate = capacity["offered"] / half  # asks/s the capacity run got through
    block = args.seconds / args.rounds
    for load, phase in loads(args):
        print(f"{phase}: flood at {load * offered_rate:.2f} asks/s", file=sys.stderr)
        for _ in range(args.rounds):
            await asker.closed_loop("quiet", alone_phase(phase), 1, block)
            await asyncio.sleep(BETWEEN_BLOCKS_S)
            await asyncio.gather(
                asker.open_loop("flood", phase, load * offered_rate, block),
                asker.closed_loop("quiet", phase, 1, block),
            )
            await asyncio.sleep(BETWEEN_BLOCKS_S)
        alone = [a for a in asker.asks if a.phase == alone_phase(phase)]
        results[alone_phase(phase)] = {"quiet": summary(alone, args.seconds)}
        results[phase] = {
            tenant: summary(
                [a for a in asker.asks if a.phase == phase and a.tenant == tenant], args.seconds
            )
            for tenant in TENANTS
        }
        asked = results[phase]["quiet"]["offered"]
        results[phase]["quiet"]["unloaded_p95"] = summary(alone[:asked], args.seconds)["p95"]
    await asker.pool.close()
    results["_asks"] = [asdict(a) for a in asker.asks]
    return results


def alone_phase(phase: str) -> str:
    """The blocks of a load's phase in which the quiet tenant asks alone."""
    return f"{phase} alone"


def table(results: dict) -> str:
    capacity = results["capacity"]["flood"]["goodput_per_s"]
    lines = [
        f"capacity {capacity:.2f} COMPLETE/s",
        "| phase | tenant | offered | COMPLETE | goodput/s (of capacity) | refused at once "
        "(p95 s) | cut at deadline | DEADLINE_EXCEEDED | other | p50 / p95 / p99 (s) | "
        "p95 / unloaded, same questions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase, by_tenant in results.items():
        if phase.startswith("_"):
            continue
        for tenant, s in by_tenant.items():
            unloaded = s.get("unloaded_p95")  # the same questions asked alone
            ratio = s["p95"] / unloaded if unloaded else float("nan")
            lines.append(
                f"| {phase} | {tenant} | {s['offered']} | {s['complete']} | "
                f"{s['goodput_per_s']:.2f} ({s['goodput_per_s'] / capacity:.0%}) | "
                f"{s['refused']} ({s['refusal_p95_s']:.3f}) | {s['cut_at_deadline']} | "
                f"{s['deadline_exceeded']} | {s['other'] or ''} | "
                f"{s['p50']:.2f} / {s['p95']:.2f} / {s['p99']:.2f} | "
                f"{'' if ratio != ratio else f'{ratio:.2f}'} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capacity = results["capacity"]["flood"]["goodput_per_s"]
    phases = [p for p in results if p.endswith("x")]
    loads = [float(p[:-1]) for p in phases]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    flood = [results[p]["flood"] for p in phases]
    goodput = [sum(s["goodput_per_s"] for s in results[p].values()) / capacity for p in phases]
    refused = [s["refused"] / max(s["offered"], 1) for s in flood]
    left.plot(loads, goodput, marker="o", label="both tenants: COMPLETE/s over capacity")
    left.plot(loads, refused, marker="s", label="flood: share refused at once")
    left.axhline(0.9, color="grey", linestyle=":", label="goal: 90% of capacity")
    left.set_xlabel("offered load (x capacity)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    quiet = [results[p]["quiet"]["p95"] / results[p]["quiet"]["unloaded_p95"] for p in phases]
    right.plot(loads, quiet, marker="o", label="quiet tenant p95 / unloaded p95")
    right.axhline(1.5, color="grey", linestyle=":", label="goal: 1.5")
    right.set_xlabel("offered load (x capacity)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    figure.suptitle("Ask under open-loop load: goodput and a quiet tenant's latency")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def loads(args) -> list[tuple[float, str]]:
    """Each offered load (x capacity) and the name of its phase."""
    return [(float(x), f"{float(x):g}x") for x in args.load.split(",")]


def tenants(args) -> list[str]:
    """Every tenant the run asks as: the flood, and the quiet tenant of each phase."""
    phases = [p for _, phase in loads(args) for p in (alone_phase(phase), phase)]
    return [*TENANTS, *(quiet_tenant(phase) for phase in phases)]


def main() -> int:
    configure_logging("loadgen", "warning", "console")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--addr", help="a running stack: orchestrator,retrieval,embedding,rerank addresses"
    )
    parser.add_argument("--load", default="0.5,1,2,3", help="offered load, x capacity")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="per load, loaded and alone alike"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alone and loaded blocks alternating, per load"
    )
    parser.add_argument("--deadline", type=float, default=10.0, help="per Ask, seconds")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=2,
        help="the capacity run's workers (the orchestrator's RAGLINE_ORCHESTRATOR_MAX_IN_FLIGHT)",
    )
    parser.add_argument("--workdir", type=Path, default=REPO / ".ragline" / "loadgen")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the services")
    parser.add_argument("--json", type=Path, help="write every ask here")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    passages, questions = load_squad(DEMO_CORPUS)
    process = None
    if args.addr:
        names = ("orchestrator", "retrieval", "embedding", "rerank")
        addresses = dict(zip(names, args.addr.split(","), strict=False))
    else:
        overrides = dict(item.split("=", 1) for item in args.env)
        process, addresses = start_stack(args.workdir, overrides)
    try:
        if "retrieval" in addresses:
            for tenant in tenants(args):
                asyncio.run(
                    ensure_ingested(DEMO_CORPUS, addresses, args.workdir, len(passages), tenant)
                )
        results = asyncio.run(measure(addresses["orchestrator"], [q.text for q in questions], args))
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
    print(table(results))
    phases = [p for p in results if not p.startswith("_") and p != "capacity"]
    print(breakdown(results["_asks"], "quiet", phases))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
