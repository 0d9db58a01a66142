"""End to end through `Ask`: latency, throughput, orchestration overhead and answer quality.

    .venv/bin/python tools/bench_e2e.py --data ../shared/data/squaddev_v1.1.json \\
        --questions 100 --concurrency 1,4,16 --serial --plot e2e.png

Starts the whole stack (`ragline up --base-port 0 --no-demo`, data in --workdir, so a rerun
reuses the index) unless --addr points at a running one, ingests the paragraphs of the file
into a tenant of its own (`bench-<file>-h4`) once (every 4th article held out:
`--hold-out`), then asks a fixed sample of the questions about ingested articles (seeded)
at each concurrency, with the default (parallel) plan and, with --serial, the same plan
forced serial; at c=1 also `--unanswerable` questions about the held-out articles (out of
corpus: nothing in the index answers them). The answer-state table says how often each set
came back COMPLETE, whether every COMPLETE answer cited a passage, the F1 of what was
answered (an INCOMPLETE answer counts 0; with the drafts beside it), why the rest was
INCOMPLETE and how fast the answerability gate abstained. Reported per configuration, over
every request asked (failed and unfinished ones counted, never dropped; caches bypassed
except in the --cache runs): time to first token and to the complete answer (p50/p95/p99),
answers per second, refusals (RESOURCE_EXHAUSTED), failures and deadline misses, measured /
lower bound of the timing report, SQuAD exact match and token F1 (max over the gold
answers, citation markers stripped) and how often the gold paragraph reached the prompt,
and how often a COMPLETE or PARTIAL answer cited it. --env KEY=VALUE (repeatable) sets
service settings for an A/B run.
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
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from ragline import deadlines, identity
from ragline.answer_match import answer_f1, normalise, stated_in
from ragline.clients import ChannelPool, ServiceClient
from ragline.timing import seconds_of
from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from ragline_app.benchmarks import ensure_ingested, start_stack
from ragline_app.datasets import held_out_split, load_squad, load_squad_extras, write_jsonl
from ragline_app.eval_data import eval_file
from ragline_services.orchestrator.evidence import strip_markers
from ragline_services.orchestrator.plan import default_rag_plan
from ragline_services.orchestrator.servicer import plan_message

TENANT = "bench"
# A COMPLETE answer counts as right from this token F1 against a gold answer (the issue's
# definition; an out-of-corpus question has no gold answer, so COMPLETE there is wrong).
RIGHT_F1 = 0.5
REPO = Path(__file__).resolve().parents[1]


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
    # Where the time went (the run's timing report): wall time of each kind of plan step,
    # the server queue waits inside them, and the wait for admission before any step.
    step_s: dict[str, float] = field(default_factory=dict)
    step_wait_s: dict[str, float] = field(default_factory=dict)
    # ... and of the steps that call a service: the budget reservation before the call, the
    # call, and the server's own total (call - server = network and client).
    step_call_s: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    admission_wait_s: float = 0.0
    f1: float = 0.0
    em: float = 0.0
    gold_in_prompt: bool = False
    gold_cited: bool = False  # a COMPLETE or PARTIAL answer cites the question's paragraph
    answerable: bool = True  # the question's paragraph was ingested
    reason: str = ""
    citations: int = 0
    draft_f1: float = 0.0  # F1 of the answer, or of the draft an INCOMPLETE answer kept
    question: str = ""
    answerability: float = 0.0
    text: str = ""  # the answer, or the draft an INCOMPLETE answer kept
    detail: str = ""
    answer_hit: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    escalated: bool = False
    signals: tuple[str, ...] = ()
    route: str = ""
    subqueries: tuple[str, ...] = ()  # the agent plan's lookups
    parts_answered: int = 0  # multi-part questions: parts whose gold answer is in the answer
    parts_cited: int = 0  # ... and whose paragraph is cited
    # ... and cited where it is stated: its paragraph, or a cited evidence item that writes
    # the gold answer (a fact stated in several places is cited from any of them, as
    # answer-bearing passages are counted in retrieval benchmarks such as DPR's).
    parts_stated: int = 0
    # What the verifier's fit (tools/fit_verifier.py) reads again: the gold answers and
    # paragraph, the prompt's evidence (marker, title, text, document id) and the markers
    # the answer cited.
    gold: tuple[str, ...] = ()
    passage_id: str = ""
    evidence: tuple[tuple[str, str, str, str], ...] = ()
    cited: tuple[str, ...] = ()
    verified: float = -1.0  # the verifier's estimate that the answer is right (-1: none)
    answer_logprob: float | None = None  # the model's own confidence (None: not reported)


@dataclass
class Run:
    name: str
    concurrency: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def answered_s(self) -> list[float]:
        """How long each answered request took (complete answer), in order."""
        return [o.complete_s for o in self.outcomes if o.ok]

    @property
    def answers_per_s(self) -> float:
        return len(self.answered_s) / self.wall_s if self.wall_s else 0.0

    @property
    def refused(self) -> int:
        """Refused at once (RESOURCE_EXHAUSTED with a retry delay): not a failure."""
        return sum(o.code == "RESOURCE_EXHAUSTED" for o in self.outcomes)

    @property
    def failed(self) -> int:
        return sum(not o.ok and o.code != "RESOURCE_EXHAUSTED" for o in self.outcomes)


@dataclass(frozen=True)
class OutOfCorpus:
    """A question whose article was held out of the index: nothing there answers it."""

    text: str
    answers: tuple[str, ...]
    passage_id: str
    answerable: bool = False


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
    return max(answer_f1(p, gold) for p in pieces)


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
    outcome.admission_wait_s = seconds_of(result.timing.admission_wait)
    for node in result.timing.nodes:
        if node.state != orchestrator_pb2.NODE_STATE_SUCCEEDED:
            continue
        kind = orchestrator_pb2.NodeKind.Name(node.kind).removeprefix("NODE_KIND_").lower()
        spent = seconds_of(node.finished) - seconds_of(node.began)
        outcome.step_s[kind] = outcome.step_s.get(kind, 0.0) + spent
        waited = seconds_of(node.server.queue_wait)
        outcome.step_wait_s[kind] = outcome.step_wait_s.get(kind, 0.0) + waited
        if node.HasField("call_start") and node.HasField("reserve_start"):
            reserve = seconds_of(node.call_start) - seconds_of(node.reserve_start)
            call = seconds_of(node.call_end) - seconds_of(node.call_start)
            outcome.step_call_s[kind] = (reserve, call, seconds_of(node.server.total))
    outcome.answer_hit = result.cache.answer_hit
    outcome.input_tokens = result.budget.used.input_tokens
    outcome.output_tokens = result.budget.used.output_tokens
    outcome.escalated = result.escalated
    outcome.signals = tuple(s.split(":")[0] for s in result.escalation_signals)
    outcome.route = result.route
    outcome.subqueries = tuple(result.subqueries)
    if isinstance(question, MultiPart):
        cited = {c.document_id for c in result.citations}
        markers = {c.marker for c in result.citations}
        cited_texts = [e.snippet for e in result.evidence if e.marker in markers]
        for part in question.parts:
            found = max((part_f1(result.answer, gold) for gold in part.answers), default=0.0)
            stated = part.passage_id in cited or any(
                stated_in(gold, text) for gold in part.answers for text in cited_texts
            )
            outcome.parts_answered += found >= 0.5
            outcome.parts_cited += found >= 0.5 and part.passage_id in cited
            outcome.parts_stated += found >= 0.5 and stated
    outcome.reason = result.status.reason
    outcome.question, outcome.detail = question.text, result.status.detail
    outcome.text = result.answer or result.draft_answer
    outcome.answerability = result.answerability
    outcome.citations = len(result.citations)
    outcome.gold, outcome.passage_id = tuple(question.answers), question.passage_id
    outcome.evidence = tuple((e.marker, e.title, e.snippet, e.document_id) for e in result.evidence)
    outcome.cited = tuple(c.marker for c in result.citations)
    outcome.verified = result.verified if result.HasField("verified") else -1.0
    if result.HasField("answer_logprob"):
        outcome.answer_logprob = result.answer_logprob
    outcome.answerable = getattr(question, "answerable", True)
    answer = strip_markers(result.answer)
    draft = strip_markers(result.answer or result.draft_answer)
    outcome.draft_f1 = max((answer_f1(draft, gold) for gold in question.answers), default=0.0)
    outcome.f1 = max((answer_f1(answer, gold) for gold in question.answers), default=0.0)
    outcome.em = max(
        (float(normalise(answer) == normalise(g)) for g in question.answers), default=0.0
    )
    outcome.gold_in_prompt = any(c.document_id == question.passage_id for c in result.evidence)
    outcome.gold_cited = outcome.state in ("COMPLETE", "PARTIAL") and any(
        c.document_id == question.passage_id for c in result.citations
    )
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
        "measured / lower bound p50 | EM | F1 | gold in prompt | gold cited |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        ok = [o for o in run.outcomes if o.ok]
        states = collections.Counter(o.state for o in ok)
        codes = collections.Counter(
            o.code for o in run.outcomes if o.code and o.code != "RESOURCE_EXHAUSTED"
        )
        failed = f"{sum(codes.values())}" + (f" {dict(codes)}" if codes else "")
        n = max(len(run.outcomes), 1)
        cells = [
            run.name,
            str(len(run.outcomes)),
            f"{states['COMPLETE']} / {states['PARTIAL']} / {states['INCOMPLETE']}",
            str(run.refused),
            failed,
            percentiles([o.first_token_s for o in ok if o.first_token_s is not None]),
            percentiles([o.complete_s for o in ok]),
            f"{run.answers_per_s:.3f}",
            f"{np.median([o.ratio for o in ok]) if ok else 0:.3f}",
            f"{sum(o.em for o in run.outcomes) / n:.3f}",
            f"{sum(o.f1 for o in run.outcomes) / n:.3f}",
            f"{sum(o.gold_in_prompt for o in run.outcomes) / n:.2f}",
            f"{sum(o.gold_cited for o in run.outcomes) / n:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: the header, its rule, one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def steps_table(runs: list[Run]) -> str:
    """Per run, the p50 of each kind of step's wall time (ms), its server queue wait in
    brackets where there was one, and the admission wait p50 / p95: the queues of c>1;
    then, for the steps that call a service, the reservation / call / server split."""
    kinds = sorted({k for run in runs for o in run.outcomes for k in o.step_s})
    calls = sorted({k for run in runs for o in run.outcomes for k in o.step_call_s})
    steps, splits = [], []
    for run in runs:
        ok = [o for o in run.outcomes if o.ok]
        split = [run.name]
        for kind in calls:
            parts = np.array([o.step_call_s[kind] for o in ok if kind in o.step_call_s])
            medians = np.median(parts, axis=0) if len(parts) else []
            split.append(" / ".join(f"{v * 1000:.0f}" for v in medians) or "-")
        splits.append(split)
        if not ok:
            continue
        waits = np.percentile([o.admission_wait_s * 1000 for o in ok], [50, 95])
        cells = [run.name, f"{waits[0]:.0f} / {waits[1]:.0f}"]
        for kind in kinds:
            spent = [o.step_s[kind] * 1000 for o in ok if kind in o.step_s]
            queued = [o.step_wait_s.get(kind, 0.0) * 1000 for o in ok if kind in o.step_s]
            cell = f"{np.median(spent):.0f}" if spent else "-"
            if queued and np.median(queued) >= 1:
                cell += f" ({np.median(queued):.0f} queued)"
            cells.append(cell)
        steps.append(cells)
    header = ["configuration", "admission wait p50 / p95 (ms)", *(f"{k} p50 (ms)" for k in kinds)]
    called = ["configuration", *(f"{k}: reserve / call / server p50 (ms)" for k in calls)]
    return "\n".join([*markdown(header, steps), "", *markdown(called, splits)])


# issue 55's goals, as ratios to the peer (ragline's figure over the peer's, or the peer's
# time over ragline's): what the ratio table measures against.
PEER_GOALS = {"ingest": 3.0, "p50 c=1": 4.0, "answers/s c>1": 5.0, "p95 c>1": 5.0}


def peer_table(runs: list[Run], peer: dict, ingest_s: float | None) -> str:
    """ragline against the peer's report (haystack_rag.py --out): ingest, complete answer
    p50 and answers/s at c=1, answers/s and p95 at the peer's concurrency, failures; each
    ratio beside its goal."""
    by_level = {run.concurrency: run for run in runs if run.name.startswith("parallel plan")}
    lines = ["| | peer | ragline | ratio | goal |", "|---|---|---|---|---|"]

    def cell(value: float | None, unit: str) -> str:
        return "-" if value is None else f"{value:.3f}{unit}"

    def row(what: str, theirs: float | None, ours: float | None, unit: str, higher: bool):
        goal = PEER_GOALS.get(what)
        ratio = "-"
        if theirs and ours:
            ratio = f"{(ours / theirs) if higher else (theirs / ours):.2f}x"
        wanted = f">= {goal:g}x" if goal else ""
        lines.append(f"| {what} | {cell(theirs, unit)} | {cell(ours, unit)} | {ratio} | {wanted} |")

    indexing = peer.get("indexing", {})
    row("ingest", indexing.get("wall_s"), ingest_s, " s", higher=False)
    sequential, concurrent = peer.get("e2e_sequential", {}), peer.get("e2e_concurrent", {})
    alone = by_level.get(1)
    if alone is not None:
        ok = alone.answered_s
        p50 = float(np.percentile(ok, 50)) if ok else None
        row("p50 c=1", sequential.get("p50_ms", 0) / 1000 or None, p50, " s", higher=False)
        rate = alone.answers_per_s or None
        row("answers/s c=1", sequential.get("throughput_answers_per_s"), rate, "", higher=True)
    level = concurrent.get("concurrency")
    loaded = by_level.get(level)
    if loaded is not None:
        ok = loaded.answered_s
        rate = loaded.answers_per_s or None
        row("answers/s c>1", concurrent.get("throughput_answers_per_s"), rate, "", higher=True)
        p95 = float(np.percentile(ok, 95)) if ok else None
        row("p95 c>1", concurrent.get("p95_ms", 0) / 1000 or None, p95, " s", higher=False)
    failed = {run.concurrency: run.failed for run in by_level.values()}
    lines.append(f"| failed requests by concurrency | | {failed} | | 0 |")
    if level is not None:
        lines.append(
            f"(c>1 is the peer's concurrency, {level}; ragline's run at it: "
            f"{'yes' if loaded is not None else 'none, add it to --concurrency'})"
        )
    return "\n".join(lines)


def trust_table(runs: list[Run]) -> str:
    """Per run: how often COMPLETE was returned, whether every COMPLETE answer cited a
    passage, the F1 of what was answered (an INCOMPLETE answer counts 0) and of the drafts
    too, why the rest was INCOMPLETE, and how fast an abstention by the gate came back."""
    lines = [
        "| configuration | asked | COMPLETE | COMPLETE precision | right per 100 "
        "| COMPLETE without a citation | F1 (answers) "
        "| F1 (answers and drafts) | INCOMPLETE by reason | abstention p50 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        outs = run.outcomes
        n = max(len(outs), 1)
        complete = [o for o in outs if o.state == "COMPLETE"]
        reasons = collections.Counter(o.reason for o in outs if o.state == "INCOMPLETE")
        abstained = [o.complete_s for o in outs if o.reason == "no_relevant_evidence"]
        right = [o for o in complete if o.f1 >= RIGHT_F1]
        precision = f"{len(right) / len(complete):.3f}" if complete else "-"
        lines.append(
            f"| {run.name} | {len(outs)} | {len(complete) / n:.1%} | {precision} | "
            f"{100 * len(right) / n:.1f} | "
            f"{sum(o.citations == 0 for o in complete)} | {sum(o.f1 for o in outs) / n:.3f} | "
            f"{sum(o.draft_f1 for o in outs) / n:.3f} | {dict(reasons.most_common())} | "
            f"{np.median(abstained) if abstained else float('nan'):.3f} |"
        )
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
        "both answered and both paragraphs cited | both answered, each cited where it is "
        "stated | one part answered | COMPLETE | COMPLETE with a part unanswered | "
        "complete p50 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        outs = run.outcomes
        lines.append(
            f"| {run.name} | {len(outs)} | {sum(o.route == 'agent' for o in outs)} | "
            f"{sum(o.parts_answered == 2 for o in outs)} | "
            f"{sum(o.parts_cited == 2 for o in outs)} | "
            f"{sum(o.parts_stated == 2 for o in outs)} | "
            f"{sum(o.parts_answered == 1 for o in outs)} | "
            f"{sum(o.state == 'COMPLETE' for o in outs)} | "
            f"{sum(o.state == 'COMPLETE' and o.parts_answered < 2 for o in outs)} | "
            f"{percentiles([o.complete_s for o in outs if o.ok]).split(' / ')[0]} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The parallel plan's runs at several concurrencies also get the scale curve.
    curve = sorted(
        (run for run in runs if run.name.startswith("parallel plan, c=")),
        key=lambda run: run.concurrency,
    )
    figure, panels = plt.subplots(1, 2 if len(curve) > 1 else 1, figsize=(14, 5), squeeze=False)
    axes = panels[0][0]
    if len(curve) > 1:
        scale = panels[0][1]
        levels = [run.concurrency for run in curve]
        rates = [run.answers_per_s for run in curve]
        scale.plot(levels, rates, "o-", label="answers/s")
        scale.set_xscale("log", base=2)
        scale.set_xticks(levels, [str(level) for level in levels])
        scale.set_xlabel("concurrent callers")
        scale.set_ylabel("answers/s")
        tails = scale.twinx()
        p95 = [np.percentile(run.answered_s or [0], 95) for run in curve]
        tails.plot(levels, p95, "s--", color="#d62728", label="complete p95 (s)")
        tails.set_ylabel("complete answer p95 (s)")
        scale.set_ylim(bottom=0)
        for level, rate, run in zip(levels, rates, curve, strict=True):
            notes = [f"{run.refused} refused at once"] if run.refused else []
            notes += [f"{run.failed} failed"] if run.failed else []
            if notes:
                scale.annotate(", ".join(notes), (level, rate), fontsize=8)
        scale.set_title("Throughput and tail as callers grow")
        scale.grid(alpha=0.3)
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
    parser.add_argument("--data", type=Path, default=eval_file("squaddev_v1.1.json"))
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
        help="also small / routed / large at c=1 (needs the large tier, the default; "
        "--env RAGLINE_GENERATION_LARGE_MODEL= serves the small one alone): quality and cost",
    )
    parser.add_argument(
        "--multipart",
        type=int,
        default=0,
        help="also N two-part questions (pairs of questions on different paragraphs), "
        "routed (the agent plan) and with the RAG plan",
    )
    parser.add_argument(
        "--hold-out",
        type=int,
        default=4,
        help="every Nth article is not ingested: its questions are the out-of-corpus set "
        "(0: ingest every article, no such set)",
    )
    parser.add_argument(
        "--unanswerable", type=int, default=100, help="out-of-corpus questions asked (c=1)"
    )
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument(
        "--peer",
        type=Path,
        help="the framework peer's report (../shared/peers/haystack_rag.py --out FILE, same "
        "data, seed and questions, run just before): prints the ratio table against it",
    )
    parser.add_argument(
        "--disjoint",
        action="store_true",
        help="each concurrency asks its own --questions (a scale curve without cache hits)",
    )
    args = parser.parse_args()

    passages, questions = load_squad(args.data)
    impossible, two_part = load_squad_extras(args.data)
    split = held_out_split(passages, questions, every=args.hold_out)
    rng = random.Random(args.seed)
    levels = [int(c) for c in args.concurrency.split(",")]
    sample = rng.sample(split.answerable, min(args.questions, len(split.answerable)))
    # The warm-up's questions (and --disjoint's further levels) come from the rest, drawn
    # apart so that a seed's sample stays what it was: a prompt the warm-up saw would be
    # read from the engine's caches.
    chosen = {id(q) for q in sample}
    rest = [q for q in split.answerable if id(q) not in chosen]
    more = args.questions * (len(levels) - 1) if args.disjoint else 0
    extra = random.Random(args.seed + 1).sample(rest, min(8 + more, len(rest)))
    warm_up, drawn = extra[:8], sample + extra[8:]
    # --disjoint: each concurrency its own questions, so that no level reads prompts an
    # earlier one left in the engine's caches (its slots, the hot-prefix store).
    per_level = {
        level: drawn[i * args.questions : (i + 1) * args.questions] if args.disjoint else sample
        for i, level in enumerate(levels)
    }
    # Out of corpus: questions about held-out articles, and those the file says no
    # paragraph answers (SQuAD 2.0's is_impossible).
    pool = split.unanswerable + impossible
    outside = [
        OutOfCorpus(q.text, q.answers, q.passage_id)
        for q in rng.sample(pool, min(args.unanswerable, len(pool)))
    ]
    global TENANT
    data = args.data
    # A tenant per collection and cut: the ingest check counts a tenant's documents, so a
    # tenant shared by two collections would hold both (a Chinese run once answered from
    # SQuAD's passages).
    TENANT = f"bench-{args.data.stem.replace('_', '-').replace('.', '-')}"[:32]
    TENANT += f"-h{args.hold_out}"
    # Ingest reads SQuAD JSON and JSON lines; any other collection (the Chinese set's text
    # format) is written as the lines of its passages, as a cut is.
    if args.hold_out or args.data.suffix not in (".json", ".jsonl"):
        data = write_jsonl(
            split.passages, args.workdir / "data" / f"{args.data.stem}-h{args.hold_out}.jsonl"
        )
    process = None
    if args.addr:
        orchestrator, retrieval, embedding, *rerank = args.addr.split(",")
        addresses = {
            "orchestrator": orchestrator,
            "retrieval": retrieval,
            "embedding": embedding,
            "rerank": rerank[0] if rerank else None,
        }
    else:
        overrides = dict(item.split("=", 1) for item in args.env)
        process, addresses = start_stack(args.workdir, overrides)
    try:
        ingest_s = asyncio.run(
            ensure_ingested(data, addresses, args.workdir, len(split.passages), TENANT)
        )
        # Warm-up: every generation slot sees the system prompt once; not measured.
        asyncio.run(run_config("warm-up", addresses["orchestrator"], warm_up, 4, None, 60))
        runs = []
        for level in levels:
            runs.append(
                asyncio.run(
                    run_config(
                        f"parallel plan, c={level}",
                        addresses["orchestrator"],
                        per_level[level],
                        level,
                        None,
                        args.deadline,
                    )
                )
            )
            print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
            if outside and level == 1:
                # The same plan on questions whose article was never ingested.
                runs.append(
                    asyncio.run(
                        run_config(
                            "out of corpus, c=1",
                            addresses["orchestrator"],
                            outside,
                            1,
                            None,
                            args.deadline,
                        )
                    )
                )
                print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
            if args.serial and level == 1:
                runs.append(
                    asyncio.run(
                        run_config(
                            "serial plan, c=1",
                            addresses["orchestrator"],
                            sample,
                            1,
                            serial_plan(),
                            args.deadline,
                        )
                    )
                )
                print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
        extra: dict[str, list[Run]] = {"tiers": [], "multipart": []}
        if args.tiers:
            tiers = (
                ("small (pinned)", common_pb2.MODEL_TIER_SMALL),
                ("routed (escalation on signals)", common_pb2.MODEL_TIER_UNSPECIFIED),
                ("large (pinned)", common_pb2.MODEL_TIER_LARGE),
            )
            for label, tier in tiers:
                run = asyncio.run(
                    run_config(
                        label, addresses["orchestrator"], sample, 1, None, args.deadline, tier=tier
                    )
                )
                extra["tiers"].append(run)
                print(cost_table([run]).splitlines()[-1], file=sys.stderr)
        if args.multipart:
            # The file's own two-part questions where it has them, else pairs of its
            # questions joined ("A, and also B?").
            pairs = [MultiPart(t.text, t.parts) for t in two_part][: args.multipart] or (
                multipart_questions(split.answerable, args.multipart, args.seed)
            )
            choices = (
                ("multi-part, routed", orchestrator_pb2.PLAN_CHOICE_UNSPECIFIED),
                ("multi-part, RAG plan", orchestrator_pb2.PLAN_CHOICE_RAG),
            )
            for label, choice in choices:
                run = asyncio.run(
                    run_config(
                        label,
                        addresses["orchestrator"],
                        pairs,
                        1,
                        None,
                        args.deadline,
                        plan_choice=choice,
                    )
                )
                extra["multipart"].append(run)
                print(multipart_table([run]).splitlines()[-1], file=sys.stderr)
        if args.cache:
            use = orchestrator_pb2.CACHE_POLICY_UNSPECIFIED
            for label in ("first ask", "asked again"):
                run = asyncio.run(
                    run_config(
                        f"answer cache, {label}, c=1",
                        addresses["orchestrator"],
                        sample,
                        1,
                        None,
                        args.deadline,
                        cache=use,
                    )
                )
                hits = sum(o.answer_hit for o in run.outcomes)
                run.name += f" ({hits} hits)"
                runs.append(run)
                print(table(runs[-1:]).splitlines()[-1], file=sys.stderr)
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
    held = f", every {args.hold_out}th article held out" if args.hold_out else ""
    print(f"{len(sample)} questions of {args.data.name} (seed {args.seed}{held}), ", end="")
    print(f"deadline {args.deadline} s")
    print(table(runs))
    print("\nwhere the time went: steps and queues\n" + steps_table(runs))
    if args.peer:
        peer = json.loads(args.peer.read_text())
        print("\nagainst the peer (" + args.peer.name + ")\n" + peer_table(runs, peer, ingest_s))
    print("\nanswer states: can COMPLETE be trusted?\n" + trust_table(runs))
    if extra["tiers"]:
        print("\nmodel routing: the same questions, c=1\n" + cost_table(extra["tiers"]))
    if extra["multipart"]:
        print("\nmulti-part questions\n" + multipart_table(extra["multipart"]))
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    r.name: [o.__dict__ for o in r.outcomes]
                    for r in [*runs, *extra["tiers"], *extra["multipart"]]
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
