"""The model's confidence in its answer, from the tokens' probabilities."""

from __future__ import annotations

import math

from ragline.v1 import generation_pb2
from ragline_services.orchestrator import confidence


def token(text: str, logprob: float | None = None) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(text=text, logprob=logprob)


def close(found: float | None, expected: float) -> bool:
    return found is not None and math.isclose(found, expected, rel_tol=1e-6)  # float32


def test_the_mean_of_the_answers_tokens_before_its_citation():
    tokens = [token("O", -1.0), token("der", -0.2), token(" [", -0.01), token("1", -0.0),
              token("]", -0.0)]  # fmt: skip
    assert close(confidence.answer_logprob(tokens), -0.6)


def test_a_marker_split_across_tokens_still_ends_the_answer():
    tokens = [token("1893", -0.5), token(" [", -0.9), token("2", -3.0), token("]", -0.0)]
    # " [" alone could open any bracket; with the digit after it, it was a citation.
    assert close(confidence.answer_logprob(tokens), -0.5)


def test_drafted_tokens_are_not_counted_and_none_known_is_none():
    tokens = [token("Vist", -0.4), token("ula"), token(" River", -0.2), token(" [1]")]
    assert close(confidence.answer_logprob(tokens), -0.3)
    assert confidence.answer_logprob([token("Vistula"), token(" [1]")]) is None
    assert confidence.answer_logprob([]) is None
