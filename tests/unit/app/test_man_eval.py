"""The man-page QA set: its counts, its answers spans of their paragraphs, its extras."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ragline_app.datasets import held_out_split, load_squad, load_squad_extras

HERE = Path(__file__).resolve().parents[3] / "app" / "ragline_app" / "data" / "man_eval"
DATA = HERE / "man_eval_v1.json"


def test_the_set_holds_what_its_provenance_says():
    passages, questions = load_squad(DATA)
    impossible, two_part = load_squad_extras(DATA)
    assert len(passages) >= 200 and len(questions) >= 100
    assert len(impossible) >= 50 and len(two_part) == 20
    digest = hashlib.sha256(DATA.read_bytes()).hexdigest()
    assert digest in (HERE / "PROVENANCE.md").read_text()
    # No question is asked twice as answerable and impossible, nor left without answers.
    assert all(q.answers for q in questions) and not any(q.answers for q in impossible)


def test_every_answer_is_a_span_of_its_paragraph():
    passages, questions = load_squad(DATA)
    _, two_part = load_squad_extras(DATA)
    text = {p.id: p.text for p in passages}
    for question in [*questions, *(part for t in two_part for part in t.parts)]:
        for answer in question.answers:
            assert answer in text[question.passage_id], (question.text, answer)


def test_questions_paraphrase_rather_than_copy():
    passages, questions = load_squad(DATA)
    text = {p.id: p.text.lower() for p in passages}
    # No question's run of six words is copied from its paragraph.
    for question in questions:
        words = re.findall(r"[\w-]+", question.text.lower())
        runs = {" ".join(words[i : i + 6]) for i in range(len(words) - 5)}
        assert not any(run in text[question.passage_id] for run in runs), question.text


def test_the_two_halves_are_whole_articles():
    data = json.loads(DATA.read_text())
    assert [a["title"] for a in data["data"]][:3] == ["ssh_config(5)", "zstd(1)", "gzip(1)"]
    passages, questions = load_squad(DATA)
    # With nothing held out, every answerable question's paragraph is ingested.
    split = held_out_split(passages, questions, every=0)
    assert len(split.answerable) == len(questions) and not split.unanswerable
