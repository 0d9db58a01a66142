"""The Chinese evaluation set (app/ragline_app/data/zh_eval): what it must hold to measure
what issue 37 asks, read by the loader the tools use, and the character F1 its answers are
scored by."""

from __future__ import annotations

import pytest

from ragline.answer_match import answer_f1, char_f1
from ragline.words import has_han
from ragline_app.datasets import load_squad, load_zh_eval
from support import REPO_ROOT

SET = REPO_ROOT / "app" / "ragline_app" / "data" / "zh_eval" / "zh_eval_v1.txt"


@pytest.fixture(scope="module")
def collection():
    return load_zh_eval(SET)


def test_the_set_holds_what_it_must_measure(collection):
    chinese = [p for p in collection.passages if has_han(p.text)]
    assert len(chinese) >= 100
    assert len(collection.questions) + len(collection.unanswerable) >= 300
    assert sum(q.cross_lingual for q in collection.questions) >= 50
    assert len(collection.unanswerable) >= 50
    assert len({p.id for p in collection.passages}) == len(collection.passages)
    assert len({q.id for q in collection.questions}) == len(collection.questions)


def test_a_same_language_answer_is_quoted_from_its_paragraph(collection):
    """Gold answers of Q: lines are spans of their paragraph (extractive, as in SQuAD and
    CMRC); a cross-lingual one may be a translation."""
    text = {p.id: p.text for p in collection.passages}
    unquoted = [
        (q.text, q.answers)
        for q in collection.questions
        if not q.cross_lingual and not any(a in text[q.passage_id] for a in q.answers)
    ]
    assert not unquoted


def test_cross_lingual_questions_are_in_the_other_language(collection):
    chinese_paragraph = {p.id: has_han(p.text) for p in collection.passages}
    for question in collection.questions:
        same = has_han(question.text) == chinese_paragraph[question.passage_id]
        assert same != question.cross_lingual, question.text


def test_its_provenance_names_this_file():
    import hashlib

    digest = hashlib.sha256(SET.read_bytes()).hexdigest()
    assert digest in (SET.parent / "PROVENANCE.md").read_text()


def test_the_tools_loader_reads_it(collection):
    passages, questions = load_squad(SET)
    assert passages == collection.passages and questions == collection.questions


def test_a_malformed_line_is_named(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("## t\nP: 段落。\nQ: 没有答案的问题？\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.txt:3"):
        load_zh_eval(bad)


def test_chinese_answers_are_scored_by_characters_and_english_by_words():
    assert char_f1("约6300公里", "约6300公里") == 1.0
    # 6 characters shared of 9 predicted ("答案是6300公里": punctuation left out) and 7 gold
    assert answer_f1("答案是：6300公里。", "约6300公里") == pytest.approx(2 * 6 / (9 + 7))
    assert answer_f1("the East China Sea", "East China Sea") == 1.0
    assert answer_f1("东海", "East China Sea") == 0.0
