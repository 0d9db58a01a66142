from __future__ import annotations

import time

import pytest

from ragline.breaker import Breaker, BreakerOpen


class Silence(Exception):
    pass


class Refusal(Exception):
    pass


def call(breaker: Breaker, outcome: Exception | None = None, *, probe: bool = False) -> str:
    try:
        with breaker.attempt(probe=probe):
            if outcome is not None:
                raise outcome
        return "ok"
    except BreakerOpen:
        return "skipped"
    except Exception as error:
        return type(error).__name__


def test_silence_opens_it_an_answer_closes_it():
    breaker = Breaker(lambda e: isinstance(e, Silence), trial_every_s=60)
    assert call(breaker, Refusal()) == "Refusal" and not breaker.open  # an answer
    assert call(breaker, Silence()) == "Silence" and breaker.open
    assert call(breaker) == "ok"  # the first trial goes
    assert not breaker.open


def test_while_open_one_trial_per_interval_and_probes_always_go():
    breaker = Breaker(lambda e: isinstance(e, Silence), trial_every_s=0.2)
    call(breaker, Silence())
    assert call(breaker, Silence()) == "Silence"  # the trial, still silent
    assert call(breaker) == "skipped"
    assert call(breaker, Silence(), probe=True) == "Silence"
    assert call(breaker) == "skipped"
    time.sleep(0.25)
    assert call(breaker) == "ok" and not breaker.open


def test_a_trial_in_flight_holds_the_others_back():
    breaker = Breaker(lambda e: isinstance(e, Silence), trial_every_s=0.0)
    call(breaker, Silence())
    with breaker.attempt():
        assert call(breaker) == "skipped"
    assert not breaker.open


def test_the_open_error_says_for_how_long():
    breaker = Breaker(lambda e: True, trial_every_s=60)
    call(breaker, Silence())
    call(breaker, Silence())  # the trial, silent too
    with pytest.raises(BreakerOpen, match=r"no answer for \d"):
        with breaker.attempt():
            pass
