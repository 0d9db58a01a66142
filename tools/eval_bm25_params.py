"""BM25's k1 and b: nDCG@10, Recall@50 and search time for each parameter set, one run.

    .venv/bin/python tools/eval_bm25_params.py ../shared/data/squaddev_v1.1.json \\
        ../shared/data/new_wiki_v1.0.json app/ragline_app/data/zh_eval/zh_eval_v1.txt \\
        [--every 2] [--params 1.2/0.75,1.5/0.75,0.9/0.4] [--json out.json]

Indexes every paragraph of each file into the service's BM25 index (one tenant), asks
every `--every`-th question (top 50, the orchestrator's BM25 list) with Tantivy's own
scores (k1 1.2, b 0.75: `native`) and with each parameter set scored again from Tantivy's
term statistics (bm25_params.py), and reports quality and the search time per query (p50 /
p95), so the cost of scoring again is measured beside the native search in the same run.
The native parameters scored again must reproduce the native ranking (a check of the
rescoring itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ragline_app.benchmarks import bm25_eval_index, bm25_rankings
from ragline_app.datasets import load_squad
from ragline_services.retrieval.bm25_params import TANTIVY_B, TANTIVY_K1, Bm25Params

# The orchestrator's BM25 list (RAGLINE_ORCHESTRATOR_CANDIDATES): Recall@50 is what
# reaches fusion and rerank.
K = 50


class _Rescored(Bm25Params):
    """Tantivy's own parameters, forced through the rescoring path (a check of it)."""

    @property
    def native(self) -> bool:
        return False


def evaluate(path: Path, every: int, sets: list[tuple[str, Bm25Params]]) -> list[dict]:
    passages, questions = load_squad(path)
    chosen = questions[::every]
    rows = []
    with bm25_eval_index(passages) as index:
        for name, params in sets:
            index.params = params
            m, times = bm25_rankings(index, chosen, K)
            rows.append(
                {
                    "data": path.name,
                    "params": name,
                    "questions": len(chosen),
                    "passages": len(passages),
                    "ndcg@10": round(m["ndcg@10"], 4),
                    "recall@50": round(m["recall@100"], 4),  # 50 returned
                    "p50_ms": round(statistics.median(times) * 1000, 2),
                    "p95_ms": round(sorted(times)[int(0.95 * len(times))] * 1000, 2),
                }
            )
    return rows


def parse_sets(text: str) -> list[tuple[str, Bm25Params]]:
    sets: list[tuple[str, Bm25Params]] = [
        ("native 1.2/0.75", Bm25Params()),
        ("rescored 1.2/0.75", _Rescored(TANTIVY_K1, TANTIVY_B)),
    ]
    for item in text.split(","):
        k1, _, b = item.partition("/")
        params = Bm25Params(float(k1), float(b or TANTIVY_B))
        if not params.native:
            sets.append((f"rescored {params.k1:g}/{params.b:g}", params))
    return sets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--params", default="1.5/0.75")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sets = parse_sets(args.params)
    rows = [row for path in args.data for row in evaluate(path, args.every, sets)]
    print("| data | parameters | questions | nDCG@10 | Recall@50 | search p50 / p95 ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['data']} | {r['params']} | {r['questions']} | {r['ndcg@10']:.3f} | "
            f"{r['recall@50']:.3f} | {r['p50_ms']:.2f} / {r['p95_ms']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
