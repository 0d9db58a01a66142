"""Readers for the evaluation collections (SQuAD-format JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Passage:
    id: str  # "<split>:<article_idx>:<paragraph_idx>"
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    passage_id: str  # the paragraph it was written from (the one relevant passage)
    answers: tuple[str, ...]


def load_squad(path: Path, split: str | None = None) -> tuple[list[Passage], list[Question]]:
    data = json.loads(Path(path).read_text())
    split = split or Path(path).stem
    passages, questions = [], []
    for a_idx, article in enumerate(data["data"]):
        title = article["title"].replace("_", " ")
        for p_idx, paragraph in enumerate(article["paragraphs"]):
            passage_id = f"{split}:{a_idx}:{p_idx}"
            passages.append(Passage(passage_id, title, paragraph["context"]))
            for qa in paragraph["qas"]:
                questions.append(
                    Question(
                        qa["id"],
                        qa["question"],
                        passage_id,
                        tuple(a["text"] for a in qa.get("answers", ())),
                    )
                )
    return passages, questions


@dataclass(frozen=True)
class HeldOutSplit:
    """A collection cut by article: the paragraphs of the kept articles are ingested, the
    questions about them are answerable; the questions about held-out articles are not
    (their paragraphs were never ingested)."""

    passages: list[Passage]
    answerable: list[Question]
    unanswerable: list[Question]


def article_of(passage_id: str) -> int:
    return int(passage_id.split(":")[-2])


def held_out_split(
    passages: list[Passage], questions: list[Question], every: int = 4
) -> HeldOutSplit:
    """Every `every`-th article (index % every == every - 1) held out; 0 holds none out."""

    def held(passage_id: str) -> bool:
        return every > 0 and article_of(passage_id) % every == every - 1

    return HeldOutSplit(
        [p for p in passages if not held(p.id)],
        [q for q in questions if not held(q.passage_id)],
        [q for q in questions if held(q.passage_id)],
    )


def write_jsonl(passages: list[Passage], path: Path) -> Path:
    """Passages as `ragline ingest` JSONL (id, title, text), written once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": p.id, "title": p.title, "text": p.text}) for p in passages]
    text = "\n".join(lines) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path
