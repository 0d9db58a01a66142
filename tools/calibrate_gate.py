"""Calibrates the answerability gate: can the evidence answer the question, decided before
generation (services/ragline_services/orchestrator/answerability.py).

    .venv/bin/python tools/calibrate_gate.py --data ../shared/data/squaddev_v1.1.json \\
        --data ../shared/data/new_wiki_v1.0.json --questions 600 --plot gate.png

Each collection (`--data`, repeatable) is cut by article: every 4th article is held out
(`--hold-out`), the paragraphs of the others are ingested into a tenant of their own (once;
a rerun reuses the index in --workdir). For each collection, a seeded sample of questions
is then run through the orchestrator's own plan steps (embed, BM25, vector search, fusion,
rerank, evidence selection: the executors of services/ragline_services/orchestrator/steps.py,
in process, against the real services) up to the gate, never generating:
- answerable: questions about the ingested articles;
- unanswerable: questions about its held-out articles and those written to have no answer
  (the Chinese set's), then the other collections' questions (asked in this collection's
  tenant), as many as the answerable ones.

Writes every question's signals to --out (JSONL), fits the gate's logistic weights on the
first collection (`--fit`), and reports for each collection the trade-off at each threshold:
answerable questions the gate lets through (and how many of them had their gold paragraph
in the evidence), unanswerable ones it lets through. `--from FILE` re-analyses signals
already written, without a stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import uuid
from pathlib import Path

import numpy as np

from ragline import deadlines, identity
from ragline.budget import Amounts, TaskBudget
from ragline.clients import ChannelPool, ServiceClient
from ragline.logs import configure_logging
from ragline.timing import duration
from ragline.v1 import (
    budget_pb2,
    budget_pb2_grpc,
    embedding_pb2_grpc,
    generation_pb2_grpc,
    rerank_pb2_grpc,
    retrieval_pb2_grpc,
)
from ragline_app.benchmarks import ensure_ingested, start_stack
from ragline_app.datasets import held_out_split, load_squad, load_zh_eval, write_jsonl
from ragline_app.eval_data import eval_file
from ragline_services.orchestrator import answerability
from ragline_services.orchestrator.plan import Kind, Plan, default_rag_plan
from ragline_services.orchestrator.run_context import Clients, RunContext, Settings
from ragline_services.orchestrator.runner import NodeState, PlanRunner
from ragline_services.orchestrator.service import OrchestratorConfig
from ragline_services.orchestrator.steps import executors_for

REPO = Path(__file__).resolve().parents[1]
FEATURES = ("similarity", "coverage", "key_terms")


def gate_plan() -> Plan:
    """The default RAG plan up to (and with) the evidence step: what the gate reads."""
    return Plan(tuple(n for n in default_rag_plan().nodes if n.kind != Kind.GENERATE))


def clients_for(addresses: dict[str, str], tenant: str, pool: ChannelPool) -> Clients:
    caller = identity.Caller(tenant)

    def client(stub, name: str) -> ServiceClient:
        return ServiceClient(stub, addresses.get(name, "127.0.0.1:1"), pool=pool, caller=caller)

    return Clients(
        embedding=client(embedding_pb2_grpc.EmbeddingServiceStub, "embedding"),
        retrieval=client(retrieval_pb2_grpc.RetrievalServiceStub, "retrieval"),
        rerank=client(rerank_pb2_grpc.RerankServiceStub, "rerank"),
        generation=client(generation_pb2_grpc.GenerationServiceStub, "generation"),
        budget=client(budget_pb2_grpc.BudgetServiceStub, "budget"),
        limits={
            name: asyncio.Semaphore(16)
            for name in ("embedding", "retrieval", "rerank", "generation", "budget")
        },
    )


def settings_for(question: str) -> Settings:
    """The orchestrator's defaults, as a server with no RAGLINE_ORCHESTRATOR_* set uses."""
    c = OrchestratorConfig()
    return Settings(
        question=question,
        candidates=c.candidates,
        fusion=c.fusion,
        vector_weight=c.vector_weight,
        rerank_candidates=c.rerank_candidates,
        late_interaction_k=c.late_interaction_k,
        rerank_cross_encoder=c.rerank_cross_encoder,
        context_passages=c.context_passages,
        evidence_tokens=c.evidence_tokens,
        embed_sentences=c.embed_sentences,
        # the signals of every question are wanted, not the gate's decision
        answerable_threshold=0.0,
    )


async def signals_of(clients: Clients, budget: TaskBudget, question, label: str) -> dict:
    ctx = RunContext(clients, budget, settings_for(question.text), uuid.uuid4().hex, print)
    with deadlines.deadline_scope(30):
        result = await PlanRunner(gate_plan(), executors_for(ctx)).run()
        await ctx.wait_settled()
    row = {"question": question.text, "label": label, "passage_id": question.passage_id}
    evidence = result.records["evidence"]
    if evidence.state != NodeState.SUCCEEDED or evidence.output.signals is None:
        return {**row, "failure": evidence.error or "no evidence"}
    fused = result.records["fuse"].output.passages
    row.update(evidence.output.signals.as_dict())
    row["gold_in_evidence"] = any(
        i.passage.id == question.passage_id for i in evidence.output.items
    )
    row["vector_top"] = max((p.scores.get("vector", 0.0) for p in fused[:4]), default=0.0)
    row["bm25_top"] = max((p.scores.get("bm25", 0.0) for p in fused[:4]), default=0.0)
    # Candidate signals the gate does not use (yet): for comparing, never read by the fit.
    ranked = result.records["rerank"].output or result.records["fuse"].output
    heads = ranked.passages[:4]
    keys = answerability.key_terms(question.text)
    bags = [set(answerability.terms(f"{p.title} {p.text}")) for p in heads]
    asked = set(answerability.terms(question.text))
    if keys and bags:
        row["key_best"] = max(sum(k in b for k in keys) / len(keys) for b in bags)
    else:
        row["key_best"] = 1.0
    chosen = set(answerability.terms(" ".join(i.text for i in evidence.output.items)))
    row["coverage_evidence"] = len(asked & chosen) / len(asked) if asked else 0.0
    return row


async def collect(addresses, tenant: str, asked: list[tuple[object, str]], concurrency: int):
    pool = ChannelPool()
    clients = clients_for(addresses, tenant, pool)
    budget = TaskBudget(clients.budget, f"calibrate-{uuid.uuid4().hex[:8]}")
    limits = Amounts(input_tokens=10**12, output_tokens=10**9, cost_micros=10**12, calls=10**9)
    request = budget_pb2.OpenTaskRequest(task_id=budget.task_id, limits=limits.to_proto())
    request.timeout.CopyFrom(duration(24 * 3600))
    with deadlines.deadline_scope(30):
        await budget.call("OpenTask", request)
    rows: list[dict] = []
    queue = list(asked)

    async def worker():
        while queue:
            question, label = queue.pop(0)
            rows.append(await signals_of(clients, budget, question, label))
            if len(rows) % 100 == 0:
                print(f"  {tenant}: {len(rows)} / {len(asked)}", file=sys.stderr)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await pool.close()
    return rows


# -- analysis -----------------------------------------------------------------------------------


def matrix(rows: list[dict], features=FEATURES) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[r[f] for f in features] for r in rows], dtype=np.float64)
    y = np.array([r["label"] == "answerable" for r in rows], dtype=np.float64)
    return x, y


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, steps: int = 50):
    """Weights and bias of a logistic regression (Newton's method, a small L2 penalty),
    with classes weighted equally whatever their sizes."""
    xb = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(xb.shape[1])
    balance = np.where(y == 1, 0.5 / max(y.sum(), 1), 0.5 / max((1 - y).sum(), 1)) * len(y)
    for _ in range(steps):
        p = 1 / (1 + np.exp(-xb @ w))
        gradient = xb.T @ (balance * (p - y)) + l2 * np.r_[w[:-1], 0]
        hessian = (xb * (balance * p * (1 - p))[:, None]).T @ xb + l2 * np.eye(len(w))
        w -= np.linalg.solve(hessian, gradient)
    return w[:-1], float(w[-1])


def probabilities(x: np.ndarray, weights, bias: float) -> np.ndarray:
    return 1 / (1 + np.exp(-(x @ np.asarray(weights) + bias)))


def curve(rows: list[dict], weights, bias, thresholds) -> list[dict]:
    x, y = matrix(rows)
    p = probabilities(x, weights, bias)
    gold = np.array([bool(r.get("gold_in_evidence")) for r in rows])
    out = []
    for t in thresholds:
        passed = p >= t
        out.append(
            {
                "threshold": t,
                "answerable_passed": passed[y == 1].mean() if (y == 1).any() else 0.0,
                "answerable_gold_passed": passed[(y == 1) & gold].mean()
                if ((y == 1) & gold).any()
                else 0.0,
                "unanswerable_passed": passed[y == 0].mean() if (y == 0).any() else 0.0,
            }
        )
    return out


def report(by_collection: dict[str, list[dict]], fit_on: str, plot_path: Path | None) -> None:
    rows = [r for r in by_collection[fit_on] if "failure" not in r]
    weights, bias = fit_logistic(*matrix(rows))
    print(f"fitted on {fit_on} ({len(rows)} questions):")
    print("  weights " + ", ".join(f"{f} {w:.3f}" for f, w in zip(FEATURES, weights, strict=True)))
    print(f"  bias {bias:.3f}")
    # The gate's model for runs where no sentence could be embedded (answerability.LEXICAL).
    lexical = FEATURES[1:]
    lexical_weights, lexical_bias = fit_logistic(*matrix(rows, lexical))
    print(
        "  without similarity: weights "
        + ", ".join(f"{f} {w:.3f}" for f, w in zip(lexical, lexical_weights, strict=True))
        + f", bias {lexical_bias:.3f}"
    )
    thresholds = [round(t, 2) for t in np.arange(0.05, 0.96, 0.05)]
    curves = {}
    for name, found in by_collection.items():
        ok = [r for r in found if "failure" not in r]
        counts = {
            label: sum(r["label"] == label for r in ok) for label in ("answerable", "unanswerable")
        }
        gold = sum(r["label"] == "answerable" and r.get("gold_in_evidence") for r in ok)
        print(
            f"\n{name}: {counts['answerable']} answerable ({gold} with the gold paragraph in "
            f"the evidence), {counts['unanswerable']} unanswerable, "
            f"{len(found) - len(ok)} failed"
        )
        print(
            "| threshold | answerable let through | ... with gold in evidence | "
            "unanswerable let through |"
        )
        print("|---|---|---|---|")
        curves[name] = curve(ok, weights, bias, thresholds)
        for row in curves[name]:
            cells = [f"{row['threshold']:.2f}"] + [
                f"{row[k]:.3f}"
                for k in ("answerable_passed", "answerable_gold_passed", "unanswerable_passed")
            ]
            print("| " + " | ".join(cells) + " |")
    if plot_path is not None:
        plot(curves, plot_path)


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 5))
    for name, rows in curves.items():
        xs = [r["unanswerable_passed"] for r in rows]
        ys = [r["answerable_passed"] for r in rows]
        axes.plot(xs, ys, marker="o", markersize=3, label=name)
        for r in rows[1::3]:
            axes.annotate(
                f"{r['threshold']:.2f}",
                (r["unanswerable_passed"], r["answerable_passed"]),
                fontsize=6,
            )
    axes.set_xlabel("unanswerable questions let through to generation")
    axes.set_ylabel("answerable questions let through")
    axes.set_title("Answerability gate: trade-off by threshold")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    configure_logging("calibrate-gate", "warning", "console")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", type=Path, action="append")
    parser.add_argument("--hold-out", type=int, default=4, help="every Nth article held out")
    parser.add_argument("--questions", type=int, default=600, help="per label and collection")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=REPO / ".ragline" / "calibrate-gate")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the services")
    parser.add_argument("--out", type=Path, help="signals of every question (JSONL)")
    parser.add_argument("--from", dest="source", type=Path, help="analyse this JSONL instead")
    parser.add_argument("--fit", help="collection whose rows fit the weights (default: first)")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    if args.source:
        rows = [json.loads(line) for line in args.source.read_text().splitlines()]
    else:
        rows = measure(args)
    by_collection: dict[str, list[dict]] = {}
    for row in rows:
        by_collection.setdefault(row["collection"], []).append(row)
    report(by_collection, args.fit or next(iter(by_collection)), args.plot)
    return 0


def measure(args) -> list[dict]:
    datasets = args.data or [eval_file("squaddev_v1.1.json")]
    loaded = {path.stem: load_squad(path) for path in datasets}
    splits = {name: held_out_split(*found, every=args.hold_out) for name, found in loaded.items()}
    written_unanswerable = {
        path.stem: load_zh_eval(path).unanswerable for path in datasets if path.suffix == ".txt"
    }
    overrides = dict(item.split("=", 1) for item in args.env)
    process, addresses = start_stack(
        args.workdir, overrides, only="budget,embedding,retrieval,rerank"
    )
    rows: list[dict] = []
    try:
        for name, split in splits.items():
            tenant = f"calib-{name.replace('_', '-')}"[:40]
            data = write_jsonl(split.passages, args.workdir / "data" / f"{name}.jsonl")
            asyncio.run(ensure_ingested(data, addresses, args.workdir, len(split.passages), tenant))
            rng = random.Random(args.seed)
            count = min(args.questions, len(split.answerable))
            asked = [(q, "answerable") for q in rng.sample(split.answerable, count)]
            # Unanswerable: first the collection's own (held-out articles, and questions
            # written to have no answer, as the Chinese set's), in its language; then
            # other collections' questions, up to as many as the answerable ones.
            own = list(split.unanswerable) + list(written_unanswerable.get(name, ()))
            inside = rng.sample(own, min(count, len(own)))
            outside = [
                q
                for other, other_split in splits.items()
                if other != name
                for q in other_split.answerable + other_split.unanswerable
            ]
            inside += rng.sample(outside, min(count - len(inside), len(outside)))
            asked += [(q, "unanswerable") for q in inside]
            found = asyncio.run(collect(addresses, tenant, asked, args.concurrency))
            rows += [{**row, "collection": name} for row in found]
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


if __name__ == "__main__":
    sys.exit(main())
