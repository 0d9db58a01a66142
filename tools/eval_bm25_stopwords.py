"""BM25 with and without query stop words: nDCG@10, Recall@100 and search latency, one run.

    .venv/bin/python tools/eval_bm25_stopwords.py ../shared/data/squaddev_v1.1.json \\
        [../shared/data/new_wiki_v1.0.json] [--every 3] [--noisy-titles]

Indexes every paragraph of each SQuAD-format file into the service's BM25 index (one
tenant), asks every `--every`-th question three ways (all words; Lucene's 33 English stop
words dropped; the service's list, libs/ragline/stopwords.py, dropped) and reports
quality and the Tantivy search time per query (p50 / p95). `--noisy-titles` also runs a copy
whose titles are replaced by long URL-like strings full of stop words (news sites' slugs),
the case where stop words in short title fields mislead BM25.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ragline.stopwords import STOP_WORDS
from ragline_app.benchmarks import bm25_eval_index, bm25_rankings
from ragline_app.datasets import load_squad

LUCENE = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their "
    "then there these they this to was will with".split()
)


def noisy_title(title: str, number: int) -> str:
    """A news-site slug: the real title drowned in stop words and URL parts."""
    slug = "-".join(title.lower().split())
    return (
        f"https www example news com {2000 + number % 25} {number % 12 + 1} what is the "
        f"latest on the {slug} and what it means for you in the end of the day"
    )


def evaluate(path: Path, every: int, noisy: bool = False) -> list[str]:
    passages, questions = load_squad(path)
    if noisy:
        from dataclasses import replace

        passages = [replace(p, title=noisy_title(p.title, i)) for i, p in enumerate(passages)]
    rows = []
    chosen = questions[::every]
    with bm25_eval_index(passages) as index:
        for name, stop in (
            ("all words", frozenset()),
            ("Lucene 33", LUCENE),
            ("service list", STOP_WORDS),
        ):
            index.stop_words = stop
            m, times = bm25_rankings(index, chosen, 100)
            p95 = sorted(times)[int(0.95 * len(times))]
            label = f"{path.name}{' (noisy titles)' if noisy else ''}"
            rows.append(
                f"| {label} | {name} | {m['ndcg@10']:.3f} | {m['recall@100']:.3f} | "
                f"{statistics.median(times) * 1000:.2f} / {p95 * 1000:.2f} |"
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("data", type=Path, nargs="+")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--noisy-titles", action="store_true")
    args = parser.parse_args()
    print("| data | query words | nDCG@10 | Recall@100 | search p50 / p95 ms |")
    print("|---|---|---|---|---|")
    for path in args.data:
        print("\n".join(evaluate(path, args.every)))
        if args.noisy_titles:
            print("\n".join(evaluate(path, args.every, noisy=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
