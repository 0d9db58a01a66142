"""The model's own confidence in the answer it wrote: the mean log-probability of the
answer's tokens, from the probabilities the engine reports (GenerateFinal.logprobs).

The citation markers are left out: "[1]" after an answer is written with near certainty
whether the answer is right or not, and would pull every answer's mean toward sure. A
token the engine accepted from a speculative draft has no probability and is not counted
(it was the model's likeliest token; prompt lookup drafts only continuations of text
the prompt holds, so what is left is where the model chose)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ragline.v1 import generation_pb2

# Where the answer's citations begin: a "[" before a passage number.
_MARKER = re.compile(r"\[\s*\d")


def answer_logprob(tokens: Sequence[generation_pb2.TokenLogprob]) -> float | None:
    """The mean log-probability of the tokens that end before the first citation marker
    (a token holding part of it, " [", is the marker's); None when no token there has one
    (the engine gave none, or every one came from a draft)."""
    text = "".join(token.text for token in tokens)
    marker = _MARKER.search(text)
    answer_end = marker.start() if marker else len(text)
    known, end = [], 0
    for token in tokens:
        end += len(token.text)
        if end > answer_end:
            break
        if token.HasField("logprob"):
            known.append(token.logprob)
    if not known:
        return None
    return sum(known) / len(known)
