"""How many sentences the evidence step must embed: the answer's sentence in the prompt, and
the answerability gate's similarity signal, against the number embedded.

    .venv/bin/python tools/eval_evidence.py --data ../shared/data/squaddev_v1.1.json \\
        --questions 150 --seed 5

For each sampled answerable question: its paragraph and 3 others of its article that do not
hold the answer stand in for the passages retrieval gives (the paragraph first, as rerank
usually puts it); the 4 others alone stand in for a question the documents do not answer.
Their sentences are cut and shortlisted as the orchestrator does (`evidence.shortlist`:
lexical evidence and rank), the shortlist is embedded alone, one sentence at a time, with
the embedding service's own model, and `evidence.select` fills the prompt's budget. Per
shortlist size it reports:
- the share of questions whose answer sentence reached the prompt;
- the AUC of the best cosine (the gate's similarity signal) between the answered and the
  unanswered condition, the harder case where every passage is about the same subject.

`--late` adds, without any sentence embedded, the late-interaction score of each sentence
(MaxSim over the token vectors rerank keeps for a passage: the passage's own model run
pooled per sentence, 128 projected dimensions) to shortlist by, and alone.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

from ragline.embedder import PASSAGE, QUERY, input_prefixes
from ragline.embedding_backends import OnnxRuntimeBackend
from ragline.models.store import ModelStore, default_model_dir
from ragline.tokenization import Tokenizer
from ragline_app.eval_data import eval_file
from ragline_services.orchestrator import evidence as ev

SIZES = (12, 8, 6, 4)
BUDGET_TOKENS = 120  # the orchestrator's default evidence budget
OTHERS = 4


class Models:
    """The embedding model run one text at a time (as the service runs it), and with
    `--late` rerank's token encoder."""

    def __init__(self, name: str, late: bool, token_dim: int) -> None:
        store = ModelStore(default_model_dir())
        spec = store.spec(name)
        self.prefixes = input_prefixes(spec.extra)
        self.tokenizer = Tokenizer(store.file(spec.tokenizer, "tokenizer.json"), spec.max_tokens)
        self.backend = OnnxRuntimeBackend(store.file(name, "model.onnx"))
        self.tokens = None
        if late:
            from tokenizers import Tokenizer as Offsets

            from ragline_services.rerank.models import TokenEncoder

            self.tokens = TokenEncoder(store.file(name, "model.onnx"), dim=token_dim)
            self.offsets = Offsets.from_file(str(store.file(spec.tokenizer, "tokenizer.json")))
            self.offsets.enable_truncation(spec.max_tokens)

    def embed(self, texts: list[str], kind: str) -> np.ndarray:
        prefix = self.prefixes.get(kind, "")
        rows = []
        for text in texts:
            (tokenized,) = self.tokenizer.encode([prefix + text], refuse_over_limit=False)
            ids = tokenized.ids[None, :]
            rows.append(self.backend.run(ids, np.ones_like(ids))[0])
        return np.asarray(rows)

    def query_tokens(self, question: str) -> np.ndarray:
        prefix = self.prefixes.get(QUERY, "")
        (tokenized,) = self.tokenizer.encode([prefix + question], refuse_over_limit=False)
        rows = self.tokens.run_sync([tokenized])[0].tokens
        skip = len(self.offsets.encode(prefix + "x").ids) - len(self.offsets.encode("x").ids)
        return rows[skip:] if len(rows) > skip else rows

    def sentence_tokens(self, text: str, sentences: list[str]) -> list[np.ndarray]:
        """Each sentence's rows of the passage's one run (empty where the run was cut)."""
        prefix = self.prefixes.get(PASSAGE, "")
        (tokenized,) = self.tokenizer.encode([prefix + text], refuse_over_limit=False)
        rows = self.tokens.run_sync([tokenized])[0].tokens
        spans = self.offsets.encode(prefix + text).offsets[1 : 1 + len(rows)]
        out, start = [], 0
        for sentence in sentences:
            begin = text.find(sentence, start)
            end = begin + len(sentence)
            start = max(end, start)
            lo, hi = begin + len(prefix), end + len(prefix)
            keep = [j for j, (a, b) in enumerate(spans) if lo <= a < hi and b > a]
            out.append(rows[keep])
        return out


def auc(positive: list[float], negative: list[float]) -> float:
    p, n = np.asarray(positive)[:, None], np.asarray(negative)[None, :]
    return float((p > n).mean() + 0.5 * (p == n).mean())


def conditions(data: Path, questions: int, seed: int):
    """(question, answer start, the answered passages, the unanswered ones)."""
    articles = json.loads(data.read_text())["data"]
    rng = random.Random(seed)
    items = [
        (article, index, qa)
        for article in articles
        for index, paragraph in enumerate(article["paragraphs"])
        for qa in paragraph["qas"]
        if qa.get("answers")
    ]
    rng.shuffle(items)
    for article, index, qa in items:
        if questions <= 0:
            return
        answer = qa["answers"][0]
        gold = article["paragraphs"][index]["context"]
        others = [
            p["context"]
            for j, p in enumerate(article["paragraphs"])
            if j != index and answer["text"] not in p["context"]
        ]
        if len(others) < OTHERS:
            continue
        rng.shuffle(others)
        questions -= 1
        yield qa["question"], answer["answer_start"], [gold, *others[: OTHERS - 1]], others[:OTHERS]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=eval_file("squaddev_v1.1.json"))
    parser.add_argument("--questions", type=int, default=150)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--model", default="me5-small-int8")
    parser.add_argument("--late", action="store_true", help="also late-interaction scores")
    parser.add_argument(
        "--token-dim", type=int, default=128, help="rerank's RAGLINE_RERANK_TOKEN_DIM"
    )
    args = parser.parse_args()
    models = Models(args.model, args.late, args.token_dim)
    reached: dict[str, list[int]] = {}
    best: dict[str, dict[str, list[float]]] = {}
    for question, answer_start, answered, unanswered in conditions(
        args.data, args.questions, args.seed
    ):
        (asked,) = models.embed([question], QUERY)
        query_rows = models.query_tokens(question) if args.late else None
        for condition, texts in (("answered", answered), ("unanswered", unanswered)):
            passages = [ev.Passage(str(i), "", text) for i, text in enumerate(texts)]
            sentences = ev.candidate_sentences(passages)
            cosine = models.embed([s.text for s in sentences], PASSAGE) @ asked
            lexical = ev.lexical_scores(question, sentences)
            rank = np.array([0.05 / (1 + s.passage) for s in sentences])
            target = None
            if condition == "answered":  # the sentence of the first passage holding the answer
                split = ev.split_sentences(texts[0])
                start, position = 0, None
                for number, sentence in enumerate(split):
                    begin = texts[0].find(sentence, start)
                    if begin <= answer_start < begin + len(sentence):
                        position = number
                    start = begin + len(sentence)
                target = next(
                    (s.text for s in sentences if s.passage == 0 and s.position == position),
                    None,
                )
            policies = {f"lexical shortlist {k}": (lexical + rank, k, cosine) for k in SIZES}
            if args.late:
                late = np.zeros(len(sentences))
                for p_index, text in enumerate(texts):
                    mine = [i for i, s in enumerate(sentences) if s.passage == p_index]
                    split = ev.split_sentences(text)
                    rows = models.sentence_tokens(
                        text, [split[sentences[i].position] for i in mine]
                    )
                    for i, found in zip(mine, rows, strict=True):
                        late[i] = (query_rows @ found.T).max(axis=1).mean() if len(found) else 0
                for k in (6, 4):
                    policies[f"late shortlist {k}"] = (late + 0.5 * lexical + rank, k, cosine)
                policies["late alone, nothing embedded"] = (late, len(sentences), late)
            for name, (order_by, size, similarity) in policies.items():
                kept = sorted(int(i) for i in np.argsort(-order_by, kind="stable")[:size])
                chosen = ev.select(
                    question,
                    passages,
                    [sentences[i] for i in kept],
                    similarity[kept],
                    BUDGET_TOKENS,
                )
                signal = best.setdefault(name, {"answered": [], "unanswered": []})
                signal[condition].append(float(similarity[kept].max()))
                if target is not None:
                    prompt = " ".join(item.text for item in chosen.items)
                    reached.setdefault(name, []).append(int(target in prompt))
    print(f"{args.data.name}: {len(reached[next(iter(reached))])} questions (seed {args.seed})")
    print("| sentences | answer sentence in the prompt | best-cosine AUC, same-subject passages |")
    print("|---|---|---|")
    for name, found in reached.items():
        separation = auc(best[name]["answered"], best[name]["unanswered"])
        print(f"| {name} | {np.mean(found):.3f} | {separation:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
