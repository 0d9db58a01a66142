"""Reading llama-server's per-token probabilities from its stream's lines."""

from __future__ import annotations

from ragline_services.generation.engine import TokenLogprob
from ragline_services.generation.llama_engine import token_logprobs


def test_the_runner_up_is_the_likeliest_other_token_not_the_first_listed():
    # Sampled (not greedy): the token chosen is not the likeliest one.
    line = {
        "content": " V",
        "tokens": [647],
        "completion_probabilities": [
            {"id": 647, "token": " V", "logprob": -1.2,
             "top_logprobs": [{"id": 506, "logprob": -0.4}, {"id": 647, "logprob": -1.2}]},
        ],
    }  # fmt: skip
    assert token_logprobs(line) == [TokenLogprob(" V", -1.2, -0.4)]


def test_tokens_accepted_from_a_draft_are_reported_without_probabilities():
    line = {"content": "ula flows", "tokens": [5607, 27455]}
    assert token_logprobs(line) == [TokenLogprob("ula flows", None, None),
                                    TokenLogprob("", None, None)]  # fmt: skip


def test_a_token_with_no_other_listed_has_no_runner_up():
    only = {"id": 64, "token": "a", "logprob": -0.1, "top_logprobs": [{"id": 64, "logprob": -0.1}]}
    line = {"content": "a", "tokens": [64], "completion_probabilities": [only]}
    assert token_logprobs(line) == [TokenLogprob("a", -0.1, None)]
