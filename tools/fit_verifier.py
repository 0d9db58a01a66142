"""Fits the answer verifier (services/ragline_services/orchestrator/verifier.py) on answers
the stack wrote, and reports it on answers it was not fitted on.

    .venv/bin/python tools/bench_e2e.py --data ../shared/data/squaddev_v1.1.json \\
        --questions 300 --concurrency 1 --json squad.json
    .venv/bin/python tools/fit_verifier.py --fit squad.json:even --fit man.json:first \\
        --report squad.json:odd --report man.json:second --report new_wiki.json:all

Each answer of a `tools/bench_e2e.py --json` file that passed the other checks (COMPLETE
or PARTIAL there), and every out-of-corpus answer, is read again: its features are computed
from the question, the answer, and the evidence the prompt held, and its label is whether it
is right (token F1 >= 0.5 against a gold answer; an out-of-corpus answer is never right).
Two fits come out of the same answers: the words alone (`FIT`) and the words with the
model's confidence where the run recorded it (`FIT_WITH_CONFIDENCE`, `answer_logprob`).
Fit the confidence on runs of the model family `verifier.CONFIDENCE_FAMILIES` names: one
model's log-probabilities are not another's. `--words-only` reads every answer as if its
engine had reported none (the comparison).
A part of a file is chosen by article: `even` / `odd` (SQuAD-style files: by article
index // 4, so held-out and answered articles fall on both sides), `first` / `second`
(the first or second half of the articles), or `all`. Prints the weights to paste into
`verifier.FIT`, and per report part the precision of what would be COMPLETE against the
share answered, by threshold; `--plot` draws that curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ragline.answer_match import answer_f1
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator import verifier

RIGHT_F1 = 0.5
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Row:
    features: list[float]
    right: bool
    answerable: bool
    article: int
    source: str
    answer_logprob: float | None = None  # the model's confidence, where the run had it


def _article(passage_id: str) -> int:
    parts = passage_id.split(":")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else -1


def rows_of(path: Path) -> list[Row]:
    runs = json.loads(path.read_text())
    out = []
    for name, outcomes in runs.items():
        if not (name.startswith("parallel plan, c=1") or name.startswith("out of corpus")):
            continue
        for number, o in enumerate(outcomes):
            text = o.get("text") or ""
            if not text or not o.get("evidence") or ev.is_refusal(text):
                continue
            answerable = bool(o.get("answerable", True))
            if answerable and o.get("state") not in ("COMPLETE", "PARTIAL"):
                if not o.get("reason", "").startswith(("ungrounded", "unverified")):
                    continue
            items = tuple(
                ev.EvidenceItem(marker, ev.Passage(doc, title, snippet), snippet)
                for marker, title, snippet, doc in o["evidence"]
            )
            evidence = ev.Evidence(items, 0, 0)
            cited = ev.cite(text, evidence).citations
            gate = o.get("answerability") or None  # 0: the plan did not compute it
            found = verifier.features(o["question"], text, cited, items, gate)
            f1 = max((answer_f1(ev.strip_markers(text), g) for g in o.get("gold", ())), default=0)
            article = _article(o.get("passage_id", "")) if answerable else -1 - number
            out.append(Row(found.vector(), answerable and f1 >= RIGHT_F1, answerable, article,
                           name, o.get("answer_logprob")))  # fmt: skip
    return out


def part(rows: list[Row], which: str) -> list[Row]:
    if which == "all":
        return rows
    if which in ("even", "odd"):
        keep = 0 if which == "even" else 1
        return [r for r in rows if (abs(r.article) // 4) % 2 == keep]
    articles = sorted({r.article for r in rows if r.article >= 0})
    middle = articles[len(articles) // 2] if articles else 0
    if which == "first":
        return [r for r in rows if (0 <= r.article < middle) or (r.article < 0 and r.article % 2)]
    return [r for r in rows if r.article >= middle or (r.article < 0 and not r.article % 2)]


def fit(rows: list[Row], l2: float = 1.0, *, confidence: bool = False) -> verifier.Fit:
    """Logistic regression (Newton's method, an L2 penalty on the weights); with
    `confidence`, the model's confidence is a reading too (rows that have it)."""
    if confidence:
        rows = [r for r in rows if r.answer_logprob is not None]
    x = np.array([r.features for r in rows], dtype=float)
    if confidence:
        read = [verifier.confidence_read(r.answer_logprob or 0.0) for r in rows]
        x = np.hstack([x, np.array(read)[:, None]])
    y = np.array([r.right for r in rows], dtype=float)
    x1 = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(x1.shape[1])
    penalty = np.eye(x1.shape[1]) * l2
    penalty[-1, -1] = 0.0
    for _ in range(50):
        p = 1 / (1 + np.exp(-x1 @ w))
        gradient = x1.T @ (p - y) + penalty @ w
        hessian = (x1 * (p * (1 - p))[:, None]).T @ x1 + penalty
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    weights = tuple(round(float(v), 3) for v in w[:-1])
    if confidence:
        return verifier.Fit(weights[:-1], round(float(w[-1]), 3), confidence=weights[-1])
    return verifier.Fit(weights, round(float(w[-1]), 3))


@dataclass(frozen=True)
class Fits:
    """The words alone, and with the model's confidence: the server reads an answer with
    the second where its engine reported the confidence."""

    words: verifier.Fit
    with_confidence: verifier.Fit

    def estimate(self, row: Row) -> float:
        found = verifier.Features(*row.features)
        return verifier.estimate(found, row.answer_logprob, self.words, self.with_confidence)


def curve(rows: list[Row], model: Fits) -> list[tuple[float, float, float, float]]:
    """Per threshold: share of answerable answers kept, precision of kept answers, right
    answers kept per 100 answerable answers read, out-of-corpus answers kept."""
    scored = [(model.estimate(r), r) for r in rows]
    answerable = [r for r in rows if r.answerable] or [None]
    out = []
    for t in THRESHOLDS:
        kept = [r for s, r in scored if s >= t]
        right = sum(r.right for r in kept)
        out.append(
            (
                t,
                sum(r.answerable for r in kept) / len(answerable),
                right / len(kept) if kept else float("nan"),
                sum(not r.answerable for r in kept),
            )
        )
    return out


def auc(rows: list[Row], model: Fits) -> float:
    """How well the estimate ranks right answers above wrong ones (0.5: not at all)."""
    scores = [(model.estimate(r), r.right) for r in rows]
    right = [s for s, ok in scores if ok]
    wrong = [s for s, ok in scores if not ok]
    if not right or not wrong:
        return float("nan")
    above = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return above / (len(right) * len(wrong))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--fit", action="append", default=[], help="FILE:PART")
    parser.add_argument("--report", action="append", default=[], help="FILE:PART")
    parser.add_argument("--plot", type=Path)
    parser.add_argument(
        "--words-only",
        action="store_true",
        help="read every answer as if its engine gave no confidence (the words alone)",
    )
    args = parser.parse_args()

    def read(spec: str) -> list[Row]:
        path, _, which = spec.rpartition(":")
        rows = part(rows_of(Path(path)), which)
        if args.words_only:
            rows = [replace(r, answer_logprob=None) for r in rows]
        return rows

    training = [r for spec in args.fit for r in read(spec)]
    model = Fits(
        fit(training) if training else verifier.FIT,
        fit(training, confidence=True)
        if any(r.answer_logprob is not None for r in training)
        else verifier.FIT_WITH_CONFIDENCE,
    )
    print(f"fitted on {len(training)} answers ({sum(r.right for r in training)} right)")
    print(f"FIT = {model.words}")
    print(f"FIT_WITH_CONFIDENCE = {model.with_confidence}")
    print("features:", ", ".join(verifier.FEATURE_NAMES))
    curves = {}
    for spec in [*args.fit, *args.report]:
        rows = read(spec)
        curves[spec] = curve(rows, model)
        print(
            f"\n{spec}: {len(rows)} answers, {sum(r.right for r in rows)} right; "
            f"AUC {auc(rows, model):.3f}"
        )
        print("| threshold | answered (of answers read) | precision | out-of-corpus kept |")
        print("|---|---|---|---|")
        for t, answered, precision, outside in curves[spec]:
            print(f"| {t:.1f} | {answered:.3f} | {precision:.3f} | {outside} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 5))
        for spec, points in curves.items():
            path, _, which = spec.rpartition(":")
            label = f"{Path(path).stem}: {which}" + (" (fitted on)" if spec in args.fit else "")
            axes.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=label)
            for t, answered, precision, _ in points:
                axes.annotate(f"{t:.1f}", (answered, precision), fontsize=6)
        axes.set_xlabel("share of answers kept COMPLETE")
        axes.set_ylabel("precision of COMPLETE (token F1 >= 0.5)")
        axes.set_title("answer verifier: precision against answers kept, by threshold")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
