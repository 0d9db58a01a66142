"""An answer's restatement of its question is cut; an answer whose words are the question's
own head, choice or polarity is left whole."""

from __future__ import annotations

import pytest

from ragline_services.orchestrator.restatement import core


@pytest.mark.parametrize(
    ("question", "answer", "expected"),
    [
        (
            "What does it mean for a structure if it is stiff?",
            "Stiff means poor seismic performance.",
            "poor seismic performance.",
        ),
        (
            "What did Justices Harry A. Blackman and others suggest would be a result of "
            "this ruling?",
            "The result of this ruling would be the elimination of single-sex schools [2]",
            "the elimination of single-sex schools [2]",
        ),
        (
            "What was William Berry's name after he was ennobled?",
            "William Berry's name after he was ennobled was Lord Camrose",
            "Lord Camrose",
        ),
        (
            "What were you able to do if you were a white man that owned land?",
            "You could vote.",
            "vote.",
        ),
        (
            "What is the definition of postmodern music?",
            "Postmodern music is defined as music of the postmodern era",
            "music of the postmodern era",
        ),
    ],
)
def test_an_opening_restatement_is_cut(question: str, answer: str, expected: str) -> None:
    assert core(question, answer) == expected


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        # the question's words are the answer's own head: no linking verb
        (
            "In what category have the foreign reporters received recognition?",
            "Foreign Reporter of the Year",
        ),
        ("What did the Latin phrase mean?", "doctor of medicine and master of surgery"),
        # a choice: the options are the question's words
        ("Which river is longer, the Rhine or the Danube?", "The Danube is longer, at 2,850 km"),
        # the polarity stands before the verb
        ("Was the bridge built in 1900?", "No, it was built in 1901"),
        # nothing new after the restatement
        ("Is the river long?", "The river is long"),
        # a marker in the part that would be cut
        ("What does stiff mean?", "Stiff [1] means poor seismic performance"),
        # Chinese is left to the checks
        ("华沙位于哪条河流上？", "华沙位于维斯瓦河上"),
        # a plain short answer
        ("How much money did the bill require?", "$447 billion [1]"),
    ],
)
def test_an_answer_that_is_not_a_restatement_is_left_whole(question: str, answer: str) -> None:
    assert core(question, answer) == answer


def test_words_sharing_their_first_letters_count_as_the_questions() -> None:
    # "determining" / "determine", "defined" / "definition"
    question = "Which factor determines the column's ability to carry an axial load?"
    answer = "The determining factor of its ability to carry axial load is the degree of bending"
    assert core(question, answer) == "the degree of bending"
