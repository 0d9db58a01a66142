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
