"""The answer verifier: does an answer stand where the question's words are, and what else
of its kind stands in its citation."""

from __future__ import annotations

from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator import second_read, verifier


def item(text: str, marker: str = "[1]", title: str = "") -> ev.EvidenceItem:
    return ev.EvidenceItem(marker, ev.Passage(marker, title, text), text)


TESLA = item(
    "Tesla said in 1893 that wireless transmission was possible. "
    "In 1903 he built the Wardenclyffe tower."
)
WHEN = "When did Tesla say wireless transmission was possible?"


def test_the_question_words_beside_the_answer_raise_the_estimate():
    right = verifier.verify(WHEN, "1893 [1]", [TESLA], [TESLA])
    wrong = verifier.verify(WHEN, "1903 [1]", [TESLA], [TESLA])
    assert right.estimate > 0.5 > wrong.estimate
    assert wrong.features.margin < 0 < right.features.margin
    assert "another candidate" in wrong.explain()


def test_the_models_own_confidence_moves_the_estimate_where_the_engine_gave_it():
    def read(logprob: float | None, model: str = "qwen2.5-coder-0.5b") -> verifier.Verification:
        return verifier.verify(WHEN, "1893 [1]", [TESLA], [TESLA], None, logprob, model)

    sure, torn = read(-0.02), read(-1.5)
    assert sure.estimate > torn.estimate
    assert "unsure" in torn.explain() and "unsure" not in sure.explain()
    # Without it, the words alone are read (FIT), not a confidence of 0 (certain).
    words = read(None)
    assert words.estimate == verifier.FIT.estimate(words.features)
    # However low, it is read no lower than the floor: one near-zero token cannot outweigh
    # every other reading.
    floor = verifier.CONFIDENCE_FLOOR
    assert read(floor * 4).estimate == read(floor).estimate
    # The large tier's model is of the family fitted on; a model of another family is
    # sure or unsure on a scale of its own: its answers are read by their words alone.
    assert read(-1.5, "qwen2.5-coder-1.5b").estimate == torn.estimate
    assert read(-1.5, "smollm2-135m").estimate == words.estimate


def test_an_answer_of_another_kind_than_asked_is_a_mismatch():
    found = verifier.verify(WHEN, "Wardenclyffe tower [1]", [TESLA], [TESLA])
    assert found.features.type_mismatch == 1.0
    assert found.estimate < verifier.verify(WHEN, "1893 [1]", [TESLA], [TESLA]).estimate


def test_the_thing_whose_kind_is_asked_is_the_answers_head_not_an_echo():
    machines = item(
        "A non-deterministic Turing machine can be characterized by checking a certificate."
    )
    question = "What type of Turing machine can be characterized by checking a certificate?"
    named = verifier.verify(
        question, "Non-deterministic Turing machine [1]", [machines], [machines]
    )
    assert named.features.echo == 0.0
    # Nothing but the thing asked about: an echo all the same.
    bare = verifier.verify(question, "Turing machine [1]", [machines], [machines])
    assert bare.features.echo == 1.0 and bare.estimate < named.estimate
    # Elsewhere a repeated question word still counts.
    restated = verifier.verify(WHEN, "Tesla said 1893 [1]", [TESLA], [TESLA])
    assert restated.features.echo > 0


def test_an_answer_is_placed_however_its_passage_writes_it():
    """A number in words over several words, one side of a setting, a mark asked for: each
    is where the answer stands, not an answer whose words are nowhere together."""
    church = item("The church operates three hundred sixty schools and institutions overseas.")
    counted = verifier.verify(
        "How many schools does the church operate?", "360 [1]", [church], [church]
    )
    assert counted.features.unplaced == 0.0 and counted.estimate > 0.5
    tar = item(
        "Preserve access times, either by restoring them after reading (METHOD=replace, this "
        "is the default) or by not setting them (METHOD=system)."
    )
    method = verifier.verify("Which method is the default?", "replace", [tar], [tar])
    assert method.features.unplaced == 0.0 and method.estimate > 0.5
    less = item("The string for that option ends when a dollar sign ($) is found.")
    mark = verifier.verify("Which character ends the string of an option?", "$", [less], [less])
    assert mark.features.unplaced == 0.0
    # A mark the passage does not write is still nowhere.
    assert verifier.verify("Which character ends it?", "~", [less], [less]).features.unplaced


def test_expected_types_from_question_words():
    assert verifier.expected_type("When was it built?") == verifier.AnswerType.DATE
    assert verifier.expected_type("How many parts are there?") == verifier.AnswerType.NUMBER
    assert verifier.expected_type("Who designed it?") == verifier.AnswerType.PERSON
    assert verifier.expected_type("Is it free?") == verifier.AnswerType.YES_NO
    assert verifier.expected_type("华沙位于哪条河流上？") == verifier.AnswerType.ANY
    assert verifier.expected_type("长江有多长？") == verifier.AnswerType.NUMBER


def test_rivals_are_the_other_items_of_the_answers_kind():
    options = item(
        "-k, --keep-old-files: Don't replace existing files when extracting. "
        "-u, --update: Append files which are newer than the corresponding copy."
    )
    found = verifier.verify(
        "Which short option stops extraction from replacing existing files?",
        "-u [1]",
        [options],
        [options],
    )
    assert "-k" in found.rivals and "-u" not in found.rivals
    # A number written otherwise is the answer itself, not a rival of it.
    parts = item("The consideration of a bill in Stage 3 has two parts, first amendments.")
    read = verifier.verify("How many parts does it have?", "2 parts", [parts], [parts])
    assert "two" not in read.rivals and "first" not in read.rivals


def test_an_answer_whose_words_are_not_together_is_unplaced():
    found = verifier.verify(WHEN, "a Zeppelin airship", [TESLA], [TESLA])
    assert found.features.unplaced == 1.0


def test_second_read_options_follow_the_text_and_find_the_answer():
    text = "ZSTD_CLEVEL sets the level. ZSTD_NBTHREADS sets the threads."
    asked = second_read.options("ZSTD_NBTHREADS", ("ZSTD_CLEVEL",), text)
    assert asked.texts == ("ZSTD_CLEVEL", "ZSTD_NBTHREADS") and asked.answer == 1
    message = second_read.user_message("Which sets the threads?", text, asked)
    assert "A) ZSTD_CLEVEL\nB) ZSTD_NBTHREADS" in message
    assert second_read.chosen("B", asked) == 1
    assert second_read.chosen("A)", asked) == 0
    assert second_read.chosen("ZSTD_CLEVEL", asked) == 0
    assert second_read.chosen("none", asked) is None
    assert second_read.chosen("E", asked) is None  # no fifth option was asked


def test_a_numbers_unit_is_read_by_its_name_however_the_passage_writes_it():
    question = "How many kilobytes of buffer does less keep per file?"
    glued = item("By default less keeps 64KB of buffer per file. It waits 3s.")
    spelled = item("By default less keeps 64 kilobytes of buffer per file. It waits 3s.")
    read = [verifier.features(question, "64 kilobytes [1]", [it], [it]) for it in (glued, spelled)]
    assert read[0] == read[1]
    assert read[0].unplaced == 0.0
    percent = "What share of the files does zstd shrink by half?"
    shares = [
        item("zstd shrinks 60% of the files by half."),
        item("zstd shrinks 60 percent of the files by half."),
    ]
    assert verifier.features(percent, "60 percent", [shares[0]], [shares[0]]) == verifier.features(
        percent, "60 percent", [shares[1]], [shares[1]]
    )


def test_a_unit_follows_a_number_not_a_name_holding_digits():
    terms = {t.surface: t.term for t in verifier._tokens("two hours on x86 h")}
    assert terms["hours"] == verifier._term("hour") and terms["h"] == "h"
