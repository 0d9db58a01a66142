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
import tempfile
import time
from pathlib import Path

from ragline.stopwords import STOP_WORDS
from ragline_app.datasets import load_squad
from ragline_app.evaluation import ranking_metrics
from ragline_services.retrieval.bm25 import Bm25Index
from ragline_services.retrieval.documents import StoredDocument, Visibility, doc_key, point_id

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
    with tempfile.TemporaryDirectory(prefix="eval-stopwords-") as tmp:
        index = Bm25Index(Path(tmp))
        docs = [StoredDocument("eval", p.id, p.title, p.text, (), {}, None, 1) for p in passages]
        for start in range(0, len(docs), 500):
            index.apply(docs[start : start + 500], [])
        chosen = questions[::every]
        # Hits are point ids (the key map resolves only the ones a search returns).
        relevant = [point_id(doc_key("eval", q.passage_id)) for q in chosen]
        for name, stop in (
            ("all words", frozenset()),
            ("Lucene 33", LUCENE),
            ("service list", STOP_WORDS),
        ):
            rankings, times = [], []
            index.stop_words = stop
            for q in chosen:
                started = time.perf_counter()
                hits = index.search(q.text, Visibility("eval"), 100)
                times.append(time.perf_counter() - started)
                rankings.append([h.pid for h in hits])
            m = ranking_metrics(rankings, relevant)
            p95 = sorted(times)[int(0.95 * len(times))]
            label = f"{path.name}{' (noisy titles)' if noisy else ''}"
            rows.append(
                f"| {label} | {name} | {m['ndcg@10']:.3f} | {m['recall@100']:.3f} | "
                f"{statistics.median(times) * 1000:.2f} / {p95 * 1000:.2f} |"
            )
        index.close()
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
