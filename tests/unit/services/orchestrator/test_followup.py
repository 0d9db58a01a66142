"""A follow-up question is read with the subject of the user turn it refers back to."""

from __future__ import annotations

import pytest

from ragline_services.orchestrator.followup import Turn, refers_back, resolve

BEFORE = [
    Turn("user", "Tell me about Sigismund's Column in Warsaw"),
    Turn("assistant", "It is a column in the Old Town."),
]


@pytest.mark.parametrize(
    "question",
    ["And when was it built?", "How tall is it?", "what about its sculptor", "它是什么时候建的？"],
)
def test_a_question_that_refers_back_gets_the_subject(question):
    resolved = resolve(question, BEFORE)
    assert resolved.subject == "Sigismund's Column Warsaw"
    assert resolved.question == f"{question} (Sigismund's Column Warsaw)"


def test_a_question_that_stands_alone_is_read_as_it_is():
    assert resolve("Which river flows through Poznan?", BEFORE).subject == ""
    assert resolve("How tall is it?", []).question == "How tall is it?"


def test_only_user_turns_give_the_subject_and_only_the_words_not_asked_already():
    turns = [Turn("user", "Tell me about the Vistula river"), Turn("assistant", "Warsaw")]
    assert resolve("How long is the river there?", turns).subject == "Vistula"


def test_chinese_words_run_together():
    assert resolve("它有多高？", [Turn("user", "华沙的齐格蒙特圆柱")]).subject == "华沙齐格蒙特圆柱"


def test_what_refers_back():
    assert refers_back("And the capital?")
    assert not refers_back("Which river flows through Warsaw?")
