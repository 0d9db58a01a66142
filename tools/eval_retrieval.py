"""Retrieval quality per search mode, and per rerank cascade, on SQuAD-format collections.

    .venv/bin/python tools/eval_retrieval.py --data ../shared/data/squaddev_v1.1.json \
        [--data ../shared/data/new_wiki_v1.0.json] [--weights 0.3] [--fusion rrf] \
        [--rerank none,stage1,stage1+2 --rerank-sample 2000]

Indexes every paragraph (title + text) of each file with the retrieval service's own index
(Tantivy BM25 + the HNSW vector index built exactly as the service builds it), then asks
every question in each mode (BM25, VECTOR, HYBRID, PREFILTER) and reports nDCG@10,
Recall@10, Recall@100 and MRR@10 (one relevant paragraph per question). Vectors come from
the embedding model (in process, cached next to the data). `--weights` takes a list to
tune HYBRID's vector weight. Reference: plain BM25 (bm25s) nDCG@10 0.864 on SQuAD dev.

`--rerank` reranks the top `--rerank-candidates` of every mode with the rerank service's own
cascade (in process, the models of the manifest): `stage1` (late interaction) or
`stage1+2` (then the cross-encoder), on a seeded sample of `--rerank-sample` questions;
the rows without reranking are reported on the same sample. The rerank settings come from
the RAGLINE_RERANK_* variables (for example RAGLINE_RERANK_TOKEN_DIM=384 for token vectors
at full size).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from ragline.vocabulary import Fusion, SearchMode
from ragline_app.datasets import load_squad
from ragline_app.evaluation import ranking_metrics
from ragline_services.embedding.offline import squad_vectors
from ragline_services.embedding.service import EmbeddingConfig
from ragline_services.retrieval.documents import Visibility
from ragline_services.retrieval.index import RetrievalIndex
from ragline_services.retrieval.index_types import DocumentInput, IndexSettings, SearchQuery
from ragline_services.retrieval.vectors import EdgeVectorIndex


async def rerank_rankings(reranker, questions, rankings, scores, texts, args):
    """Each ranking with its top `--rerank-candidates` reordered by the cascade."""
    from ragline_services.rerank.cascade import Candidate, RerankInput

    out = []
    for question, ranking, score in zip(questions, rankings, scores, strict=True):
        head = ranking[: args.rerank_candidates]
        reply = await reranker.rerank(
            RerankInput(
                tenant="eval",
                query=question.text,
                candidates=[Candidate(pid, texts[pid], score[pid]) for pid in head],
                top_k=len(head),
                late_interaction_k=args.late_interaction_k,
                allow_skip=False,
            )
        )
        ordered = [r.id for r in reply.results]
        out.append(ordered + [pid for pid in ranking if pid not in set(ordered)])
    return out


async def evaluate(path: Path, args) -> list[tuple[str, dict]]:
    passages, questions = load_squad(path)
    p_vecs, q_vecs, _ = squad_vectors(path, args.model, passages, questions, args.threads)
    with tempfile.TemporaryDirectory(prefix="eval-retrieval-") as tmp:
        directory = Path(tmp)
        vectors = EdgeVectorIndex(directory / "vectors", p_vecs.shape[1], directory / "write.log")
        index = RetrievalIndex(directory, vectors, IndexSettings(dim=p_vecs.shape[1]), None)
        started = time.monotonic()
        for start in range(0, len(passages), 500):
            await index.upsert(
                "eval",
                [
                    DocumentInput(p.id, p.title, p.text, vector=tuple(p_vecs[start + i]))
                    for i, p in enumerate(passages[start : start + 500])
                ],
            )
        await index.maybe_build()
        print(
            f"{path.name}: indexed {len(passages)} passages and built HNSW in "
            f"{time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )
        visibility = Visibility("eval")
        base = [
            m
            for m in (SearchMode.BM25, SearchMode.VECTOR, SearchMode.PREFILTER)
            if m in args.modes.split(",")
        ]
        runs = [(mode, 0.0) for mode in base]
        if SearchMode.HYBRID in args.modes.split(","):
            runs += [(SearchMode.HYBRID, float(w)) for w in args.weights.split(",")]
        reranks = [r for r in args.rerank.split(",") if r != "none"]
        if reranks:
            import random

            count = min(args.rerank_sample, len(questions))
            chosen = sorted(random.Random(args.seed).sample(range(len(questions)), count))
            questions = [questions[i] for i in chosen]
            q_vecs = q_vecs[chosen]
        texts = {p.id: f"{p.title}. {p.text}" for p in passages}
        rows = []
        rerankers = {r: await _reranker(r == "stage1+2") for r in reranks}
        if rerankers:
            from ragline_services.rerank.service import RerankConfig

            rerank = RerankConfig()
            print(
                f"rerank: token model {rerank.token_model} ({rerank.token_dim}-d), "
                f"cross-encoder {rerank.cross_encoder_model or '-'} over "
                f"{rerank.cross_encoder_candidates} of {args.late_interaction_k}"
            )
        for mode, weight in runs:
            rankings, scores = [], []
            for q, vector in zip(questions, q_vecs, strict=True):
                result = await index.search(
                    visibility,
                    SearchQuery(
                        q.text,
                        100,
                        mode,
                        vector=tuple(vector),
                        fusion=args.fusion,
                        vector_weight=weight,
                        candidates=100,
                    ),
                )
                rankings.append([h.id for h in result.hits])
                scores.append({h.id: h.score for h in result.hits})
            label = (
                mode
                if mode != SearchMode.HYBRID
                else f"hybrid ({args.fusion}, vector weight {weight})"
            )
            rows += metric_rows(label, rankings, questions)
            for name, built in rerankers.items():
                started = time.monotonic()
                reranked = await rerank_rankings(
                    built.reranker, questions, rankings, scores, texts, args
                )
                per_query = (time.monotonic() - started) / max(len(questions), 1)
                rows += metric_rows(
                    f"{label} + {name} ({per_query * 1000:.0f} ms/query)", reranked, questions
                )
        for built in rerankers.values():
            await built.close()
        index.close()
        return rows


def metric_rows(label: str, rankings, questions) -> list[tuple[str, dict]]:
    """The row of every question, and where some cross languages (the Chinese set), one
    row for those asked in their paragraph's language and one for the others."""
    relevant = [q.passage_id for q in questions]
    rows = [(label, ranking_metrics(rankings, relevant))]
    if any(q.cross_lingual for q in questions):
        for name, cross in (("same language", False), ("cross-lingual", True)):
            chosen = [i for i, q in enumerate(questions) if q.cross_lingual == cross]
            rows.append(
                (
                    f"{label}, {name} ({len(chosen)})",
                    ranking_metrics([rankings[i] for i in chosen], [relevant[i] for i in chosen]),
                )
            )
    return rows


async def _reranker(with_cross_encoder: bool):
    from ragline.models import ModelStore
    from ragline_services.rerank.service import RerankConfig, build_reranker

    config = RerankConfig()
    if not with_cross_encoder:
        config = config.model_copy(update={"cross_encoder_model": ""})
    store = ModelStore()
    for name in filter(None, (config.token_model, config.cross_encoder_model)):
        store.prepare(name)
    return await build_reranker(config, store)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", type=Path, action="append", required=True)
    parser.add_argument(
        "--model",
        default=EmbeddingConfig.model_fields["model"].default,
        help="embedding model of the vectors (default: the embedding service's)",
    )
    parser.add_argument("--modes", default="bm25,vector,prefilter,hybrid")
    parser.add_argument("--weights", default="0.4")
    parser.add_argument("--fusion", choices=list(Fusion), default=Fusion.SCORE, type=Fusion)
    parser.add_argument("--rerank", default="none", help="none,stage1,stage1+2")
    parser.add_argument("--rerank-sample", type=int, default=2000)
    parser.add_argument("--rerank-candidates", type=int, default=30)
    parser.add_argument("--late-interaction-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--digits", type=int, default=3, help="decimals (4 to compare models a step apart)"
    )
    args = parser.parse_args()
    for path in args.data:
        rows = asyncio.run(evaluate(path, args))
        print(f"\n{path.name} ({args.model})")
        print("| mode | nDCG@10 | Recall@10 | Recall@100 | MRR@10 |\n|---|---|---|---|---|")
        for label, m in rows:
            cells = (m[key] for key in ("ndcg@10", "recall@10", "recall@100", "mrr@10"))
            print(f"| {label} | " + " | ".join(f"{v:.{args.digits}f}" for v in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
