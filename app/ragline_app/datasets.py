"""Readers for the evaluation collections: SQuAD-format JSON, and the project's own
Chinese set (`app/ragline_app/data/zh_eval`, a plain-text format read by `load_zh_eval`)."""

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
    # Asked in another language than its paragraph's (an English question over a Chinese
    # paragraph, or the reverse).
    cross_lingual: bool = False


def load_squad(path: Path, split: str | None = None) -> tuple[list[Passage], list[Question]]:
    """Paragraphs and the questions they answer (a `.txt` path: the Chinese set's format,
    its unanswerable questions left out)."""
    if Path(path).suffix == ".txt":
        collection = load_zh_eval(path, split)
        return collection.passages, collection.questions
    data = json.loads(Path(path).read_text())
    split = split or Path(path).stem
    passages, questions = [], []
    for a_idx, article in enumerate(data["data"]):
        title = article["title"].replace("_", " ")
        for p_idx, paragraph in enumerate(article["paragraphs"]):
            passage_id = f"{split}:{a_idx}:{p_idx}"
            passages.append(Passage(passage_id, title, paragraph["context"]))
            for qa in paragraph["qas"]:
                if qa.get("is_impossible") or qa.get("parts"):
                    continue  # read by load_squad_extras
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
class TwoPart:
    """A question joining two, each part answered by a paragraph of its own."""

    text: str
    parts: tuple[Question, ...]


def load_squad_extras(path: Path, split: str | None = None) -> tuple[list[Question], list[TwoPart]]:
    """The questions of a SQuAD-format file that `load_squad` leaves out: SQuAD 2.0's
    `is_impossible` ones (no paragraph answers them; passage_id "") and questions with
    `parts` (each part with its own answers and paragraph: `article`, `paragraph`)."""
    if Path(path).suffix == ".txt":
        return load_zh_eval(path, split).unanswerable, []
    data = json.loads(Path(path).read_text())
    split = split or Path(path).stem
    impossible: list[Question] = []
    multi: list[TwoPart] = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if qa.get("is_impossible"):
                    impossible.append(Question(qa["id"], qa["question"], "", ()))
                elif qa.get("parts"):
                    parts = tuple(
                        Question(
                            f"{qa['id']}-p{n}",
                            part["question"],
                            f"{split}:{part['article']}:{part['paragraph']}",
                            tuple(a["text"] for a in part["answers"]),
                        )
                        for n, part in enumerate(qa["parts"], start=1)
                    )
                    multi.append(TwoPart(qa["question"], parts))
    return impossible, multi


@dataclass(frozen=True)
class EvalCollection:
    passages: list[Passage]
    questions: list[Question]  # each answered by its passage
    unanswerable: list[Question]  # answered by no passage (passage_id "")


def load_zh_eval(path: Path, split: str | None = None) -> EvalCollection:
    """The Chinese evaluation set's text format (its header says how it is written):
    "## title" opens an article, "P:" a paragraph, then "Q:" (same language) and "X:"
    (cross-lingual) questions as "question || answer || another accepted answer", and
    "U:" lines questions no paragraph answers."""
    split = split or Path(path).stem
    passages: list[Passage] = []
    questions: list[Question] = []
    unanswerable: list[Question] = []
    title, article, paragraph = "", -1, -1
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("# "):
            continue
        kind, _, body = line.partition(" ")
        if kind == "##":
            title, article, paragraph = body.split(" | ")[0].strip(), article + 1, -1
        elif kind == "P:":
            paragraph += 1
            passages.append(Passage(f"{split}:{article}:{paragraph}", title, body.strip()))
        elif kind in ("Q:", "X:") and passages:
            question, *answers = (part.strip() for part in body.split("||"))
            if not answers:
                raise ValueError(f"{path}:{number}: a question without an answer")
            questions.append(
                Question(
                    f"{split}-q{len(questions)}",
                    question,
                    passages[-1].id,
                    tuple(answers),
                    cross_lingual=kind == "X:",
                )
            )
        elif kind == "U:":
            unanswerable.append(Question(f"{split}-u{len(unanswerable)}", body.strip(), "", ()))
        else:
            raise ValueError(f"{path}:{number}: not a line of this format: {raw[:40]!r}")
    return EvalCollection(passages, questions, unanswerable)


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
