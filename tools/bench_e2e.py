"""End to end through `Ask`: latency, throughput, orchestration overhead and answer quality.

    .venv/bin/python tools/bench_e2e.py --data ../shared/data/squaddev_v1.1.json \\
        --questions 100 --concurrency 1,4,16 --serial --plot e2e.png

Starts the whole stack (`ragline up --base-port 0 --no-demo`, data in --workdir, so a rerun
reuses the index) unless --addr points at a running one, ingests every paragraph of the
file into tenant `bench` once, then asks a fixed sample of its questions (seeded) at each
concurrency, with the default (parallel) plan and, with --serial, the same plan forced
serial. Reported per configuration, over every request asked (failed and unfinished ones
counted, never dropped; caches bypassed except in the --cache runs): time to first token
and to the complete answer (p50/p95/p99),
answers per second, refusals (RESOURCE_EXHAUSTED), failures and deadline misses,
measured / lower bound of the timing report, SQuAD exact match and token F1 (max over the
gold answers, citation markers stripped) and how often the gold paragraph reached the
prompt. --env KEY=VALUE (repeatable) sets service settings for an A/B run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from ragline import deadlines, identity
from ragline.clients import ChannelPool, ServiceClient
from ragline.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from ragline_app.datasets import load_squad
from ragline_app.evaluation import normalise, token_f1
from ragline_app.ingest import Checkpoint, ingest, prepare_rerank
from ragline_services.orchestrator.evidence import strip_markers
from ragline_services.orchestrator.plan import default_rag_plan
from ragline_services.orchestrator.servicer import plan_message

TENANT = "bench"
REPO = Path(__file__).resolve().parents[1]


# -- the stack ----------------------------------------------------------------------------------


def start_stack(workdir: Path, env_overrides: dict[str, str]) -> tuple[subprocess.Popen, dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAGLINE_DATA_DIR": str(workdir), "PYTHONUNBUFFERED": "1"}
    env.update(env_overrides)
    log = (workdir / "up.out").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "ragline_app.cli", "up", "--base-port", "0", "--no-demo"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"ragline up exited; see {workdir / 'up.out'}")
        if "ragline up: ready" in (workdir / "up.out").read_text():
            state = json.loads((workdir / "up.json").read_text())["services"]
            return process, {name: s["address"] for name, s in state.items()}
        time.sleep(1)
    process.kill()
    raise SystemExit("the stack did not start in 15 minutes")


async def ensure_ingested(data: Path, addresses: dict, workdir: Path, expected: int) -> None:
    client = ServiceClient(
        retrieval_pb2_grpc.RetrievalServiceStub,
        addresses["retrieval"],
        caller=identity.Caller(TENANT),
    )
    with deadlines.deadline_scope(30):
        status = await client.unary("IndexStatus", retrieval_pb2.IndexStatusRequest())
    if status.tenant_documents >= expected:
        if not addresses.get("rerank"):
            return
        prepared = await prepare_rerank(
            data, rerank_addr=addresses["rerank"], default_tenant=TENANT, notice=print
        )
        print(f"rerank prepared {prepared} passages", file=sys.stderr)
        return
    started = time.monotonic()
    written, _ = await ingest(
        data,
        retrieval_addr=addresses["retrieval"],
        embedding_addr=addresses["embedding"],
        default_tenant=TENANT,
        checkpoint=Checkpoint(workdir / "ingest" / f"{data.name}.json"),
        rerank_addr=addresses.get("rerank"),
        notice=print,
    )
    print(f"ingested {written} passages in {time.monotonic() - started:.0f} s", file=sys.stderr)


# -- one configuration ------------------------------------------------------------------------


def serial_plan() -> orchestrator_pb2.Plan:
    return plan_message(default_rag_plan().serial())


@dataclass
class Outcome:
    ok: bool = False
    code: str = ""  # a gRPC status name when the call failed
    state: str = ""
    first_token_s: float | None = None
    complete_s: float | None = None
    ratio: float = 0.0
    f1: float = 0.0
    em: float = 0.0
    gold_in_prompt: bool = False
    answer_hit: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    escalated: bool = False
    signals: tuple[str, ...] = ()
    route: str = ""
    parts_answered: int = 0  # multi-part questions: parts whose gold answer is in the answer
    parts_cited: int = 0  # ... and whose paragraph is cited


@dataclass
class Run:
    name: str
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass(frozen=True)
class MultiPart:
    """Two SQuAD questions on different paragraphs asked as one: "A, and also B?"."""

    text: str
    parts: tuple
    answers: tuple[str, ...] = ()
    passage_id: str = ""


def multipart_questions(questions, count: int, seed: int) -> list[MultiPart]:
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < count:
        first, second = rng.sample(questions, 2)
        if first.passage_id == second.passage_id:
            continue
        a = first.text.strip().rstrip("?").strip()
        b = second.text.strip()
        b = b[0].lower() + b[1:] if b[:2] != b[:2].upper() else b
        pairs.append(MultiPart(f"{a}, and also {b.rstrip('?')}?", (first, second)))
    return pairs


def part_f1(answer: str, gold: str) -> float:
    """The best token F1 of `gold` against one `;`-separated part of the answer (or all)."""
    pieces = [strip_markers(p) for p in answer.split(";")] + [strip_markers(answer)]
    return max(token_f1(p, gold) for p in pieces)


async def ask_one(
    client: ServiceClient, question, plan, deadline_s: float, cache: int, fields: dict
) -> Outcome:
    outcome = Outcome()
    request = orchestrator_pb2.AskRequest(question=question.text, cache=cache, **fields)
    if plan is not None:
        request.plan.CopyFrom(plan)
    started = time.monotonic()
    result = None
    try:
        with deadlines.deadline_scope(deadline_s):
            async for message in client.stream("Ask", request):
                if message.WhichOneof("event") == "delta" and outcome.first_token_s is None:
                    outcome.first_token_s = time.monotonic() - started
                elif message.WhichOneof("event") == "result":
                    result = message.result
    except grpc.aio.AioRpcError as error:
        outcome.code = error.code().name
        return outcome
    outcome.complete_s = time.monotonic() - started
    outcome.ok = True
    outcome.state = common_pb2.AnswerState.Name(result.status.state).removeprefix("ANSWER_STATE_")
    outcome.ratio = result.timing.overhead_ratio
    outcome.answer_hit = result.cache.answer_hit
    outcome.input_tokens = result.budget.used.input_tokens
    outcome.output_tokens = result.budget.used.output_tokens
    outcome.escalated = result.escalated
    outcome.signals = tuple(s.split(":")[0] for s in result.escalation_signals)
    outcome.route = result.route
    if isinstance(question, MultiPart):
        cited = {c.document_id for c in result.citations}
        for part in question.parts:
            found = max((part_f1(result.answer, gold) for gold in part.answers), default=0.0)
            outcome.parts_answered += found >= 0.5
            outcome.parts_cited += found >= 0.5 and part.passage_id in cited
    answer = strip_markers(result.answer)
    outcome.f1 = max((token_f1(answer, gold) for gold in question.answers), default=0.0)
    outcome.em = max(
        (float(normalise(answer) == normalise(g)) for g in question.answers), default=0.0
    )
    outcome.gold_in_prompt = any(c.document_id == question.passage_id for c in result.evidence)
    return outcome


async def run_config(
    name,
    address,
    questions,
    concurrency,
    plan,
    deadline_s,
    cache: int = orchestrator_pb2.CACHE_POLICY_BYPASS,
    **fields,
) -> Run:
    pool = ChannelPool()
    client = ServiceClient(
        orchestrator_pb2_grpc.OrchestratorServiceStub,
        address,
        pool=pool,
        caller=identity.Caller(TENANT),
    )
    run = Run(name, concurrency)
    queue = list(questions)

    async def worker():
        while queue:
            question = queue.pop(0)
            run.outcomes.append(await ask_one(client, question, plan, deadline_s, cache, fields))

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall_s = time.monotonic() - started
    await pool.close()
    return run


# -- report -----------------------------------------------------------------------------------


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p = np.percentile(values, [50, 95, 99])
    # milliseconds matter below 0.1 s (cache hits)
    return " / ".join(f"{v:.3f}" if v < 0.1 else f"{v:.2f}" for v in p)


def table(runs: list[Run]) -> str:
    lines = [
        "| configuration | asked | complete / partial / incomplete | refused | failed | "
        "first token p50/p95/p99 (s) | complete p50/p95/p99 (s) | answers/s | "
        "measured / lower bound p50 | EM | F1 | gold in prompt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        ok = [o for o in run.outcomes if o.ok]
        states = collections.Counter(o.state for o in ok)
        refused = sum(o.code == "RESOURCE_EXHAUSTED" for o in run.outcomes)
        codes = collections.Counter(
            o.code for o in run.outcomes if o.code and o.code != "RESOURCE_EXHAUSTED"
        )
        failed = f"{sum(codes.values())}" + (f" {dict(codes)}" if codes else "")
        n = max(len(run.outcomes), 1)
        cells = [
            run.name,
            str(len(run.outcomes)),
            f"{states['COMPLETE']} / {states['PARTIAL']} / {states['INCOMPLETE']}",
            str(refused),
            failed,
            percentiles([o.first_token_s for o in ok if o.first_token_s is not None]),
            percentiles([o.complete_s for o in ok]),
            f"{len(ok) / run.wall_s:.3f}",
            f"{np.median([o.ratio for o in ok]) if ok else 0:.3f}",
            f"{sum(o.em for o in run.outcomes) / n:.3f}",
            f"{sum(o.f1 for o in run.outcomes) / n:.3f}",
            f"{sum(o.gold_in_prompt for o in run.outcomes) / n:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(runs: list[Run]) -> str:
    lines = [
        "| configuration | EM | F1 | escalated | signals fired | input tokens (mean) "
        "| output tokens (mean) | complete p50 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        n = max(len(run.outcomes), 1)
        ok = [o for o in run.outcomes if o.ok]
        lines.append(
            f"| {run.name} | {sum(o.em for o in run.outcomes) / n:.3f} | "
            f"{sum(o.f1 for o in run.outcomes) / n:.3f} | "
            f"{sum(o.escalated for o in run.outcomes)} | "
            f"{dict(collections.Counter(x for o in run.outcomes for x in o.signals))} | "
            f"{sum(o.input_tokens for o in ok) / max(len(ok), 1):.0f} | "
            f"{sum(o.output_tokens for o in ok) / max(len(ok), 1):.0f} | "
            f"{percentiles([o.complete_s for o in ok]).split(' / ')[0]} |"
        )
    return "\n".join(lines)


def multipart_table(runs: list[Run]) -> str:
    lines = [
        "| configuration | asked | routed to the agent | both parts answered | "
        "both answered and both paragraphs cited | one part answered | complete p50 (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        outs = run.outcomes
        lines.append(
            f"| {run.name} | {len(outs)} | {sum(o.route == 'agent' for o in outs)} | "
            f"{sum(o.parts_answered == 2 for o in outs)} | "
            f"{sum(o.parts_cited == 2 for o in outs)} | "
            f"{sum(o.parts_answered == 1 for o in outs)} | "
            f"{percentiles([o.complete_s for o in outs if o.ok]).split(' / ')[0]} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5))
    for run in runs:
        for attribute, style in (("complete_s", "-"), ("first_token_s", ":")):
            values = sorted(getattr(o, attribute) for o in run.outcomes if getattr(o, attribute))
            if values:
                share = np.arange(1, len(values) + 1) / len(run.outcomes)
                label = f"{run.name} ({'complete' if attribute == 'complete_s' else 'first token'})"
                axes.step(values, share, style, where="post", label=label)
    axes.set_xlabel("seconds")
    axes.set_ylabel("share of requests asked (failed ones never arrive)")
    axes.set_title("Ask latency: first token (dotted) and complete answer (solid)")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared/data/squaddev_v1.1.json")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--serial", action="store_true", help="also the plan forced serial (c=1)")
    parser.add_argument("--deadline", type=float, default=30.0, help="per Ask, seconds")
    parser.add_argument("--workdir", type=Path, default=REPO / ".ragline" / "bench-e2e")
    parser.add_argument("--addr", help="orchestrator,retrieval,embedding[,rerank] (running)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the services")
    parser.add_argument(
        "--cache",
        action="store_true",
        help="also the answer cache: every question asked once (misses, stored), then again "
        "(hits), at c=1; the other configurations bypass the caches",
    )
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="also small / routed / large at c=1 (needs a large tier: --env "
        "RAGLINE_GENERATION_LARGE_MODEL=qwen2.5-coder-1.5b): quality and cost",
    )
    parser.add_argument(
        "--multipart",
        type=int,
        default=0,
        help="also N two-part questions (pairs of questions on different paragraphs), "
        "routed (the agent plan) and with the RAG plan",
    )
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args()

    passages, questions = load_squad(args.data)
    sample = random.Random(args.seed).sample(questions, min(args.questions, len(questions)))
    process = None
    if args.addr:
        orchestrator, retrieval, embedding, *rerank = args.addr.split(",")
        addresses = {"orchestrator": orchestrator, "retrieval": retrieval, "embedding": embedding,
                     "rerank": rerank[0] if rerank else None}  # fmt: skip
    else:
        overrides = dict(item.split("=", 1) for item in args.env)
        process, addresses = start_stack(args.workdir, overrides)
    try:
        asyncio.run(ensure_ingested(args.data, addresses, args.workdir, len(passages)))
        # Warm-up: every generation slot sees the system prompt once; not measured.
        asyncio.run(run_config("warm-up", addresses["orchestrator"], sample[:8], 4, None, 60))
        runs = []
        for level in (int(c) for c in args.concurrency.split(",")):
            runs.append(
                asyncio.run(run_config(f"parallel plan, c={level}", addresses["orchestrator"],
                                       sample, level, None, args.deadline))
            )  # fmt: skip
            print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
            if args.serial and level == 1:
                runs.append(
                    asyncio.run(run_config("serial plan, c=1", addresses["orchestrator"], sample,
                                           1, serial_plan(), args.deadline))
                )  # fmt: skip
                print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
        extra: dict[str, list[Run]] = {"tiers": [], "multipart": []}
        if args.tiers:
            tiers = (("small (pinned)", common_pb2.MODEL_TIER_SMALL),
                     ("routed (escalation on signals)", common_pb2.MODEL_TIER_UNSPECIFIED),
                     ("large (pinned)", common_pb2.MODEL_TIER_LARGE))  # fmt: skip
            for label, tier in tiers:
                run = asyncio.run(run_config(label, addresses["orchestrator"], sample, 1,
                                             None, args.deadline, tier=tier))  # fmt: skip
                extra["tiers"].append(run)
                print(cost_table([run]).splitlines()[-1], file=sys.stderr)
        if args.multipart:
            pairs = multipart_questions(questions, args.multipart, args.seed)
            choices = (("multi-part, routed", orchestrator_pb2.PLAN_CHOICE_UNSPECIFIED),
                       ("multi-part, RAG plan", orchestrator_pb2.PLAN_CHOICE_RAG))  # fmt: skip
            for label, choice in choices:
                run = asyncio.run(run_config(label, addresses["orchestrator"], pairs, 1, None,
                                             args.deadline, plan_choice=choice))  # fmt: skip
                extra["multipart"].append(run)
                print(multipart_table([run]).splitlines()[-1], file=sys.stderr)
        if args.cache:
            use = orchestrator_pb2.CACHE_POLICY_UNSPECIFIED
            for label in ("first ask", "asked again"):
                run = asyncio.run(run_config(f"answer cache, {label}, c=1",
                                             addresses["orchestrator"], sample, 1, None,
                                             args.deadline, cache=use))  # fmt: skip
                hits = sum(o.answer_hit for o in run.outcomes)
                run.name += f" ({hits} hits)"
                runs.append(run)
                print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
    print(f"{len(sample)} questions of {args.data.name} (seed {args.seed}), ", end="")
    print(f"deadline {args.deadline} s")
    print(table(runs))
    if extra["tiers"]:
        print("\nmodel routing: the same questions, c=1\n" + cost_table(extra["tiers"]))
    if extra["multipart"]:
        print("\nmulti-part questions\n" + multipart_table(extra["multipart"]))
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        args.json.write_text(
            json.dumps({r.name: [o.__dict__ for o in r.outcomes] for r in runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
