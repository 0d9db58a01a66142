"""Failing fast while a store is known not to answer.

A store that has gone silent (no reset, only timeouts) costs every call its whole timeout
to learn what the previous call learnt. After a call times out or cannot connect, the
breaker opens: calls fail at once (`BreakerOpen`), but for one trial at a time every
`trial_every_s` and the health probe's calls, and the first call that succeeds closes it.
A store that answers with an error (a refusal, a conflict) is answering: that does not
open it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class BreakerOpen(Exception):
    def __init__(self, silent_s: float) -> None:
        super().__init__(f"no answer for {silent_s:.1f} s")
        self.silent_s = silent_s


class Breaker:
    def __init__(self, is_silence: Callable[[Exception], bool], trial_every_s: float = 1.0):
        self._is_silence = is_silence
        self._trial_every_s = trial_every_s
        self._silent_since: float | None = None
        self._last_trial = 0.0
        self._trial_in_flight = False

    @property
    def open(self) -> bool:
        return self._silent_since is not None

    @contextlib.contextmanager
    def attempt(self, *, probe: bool = False) -> Iterator[None]:
        """Around one call; raises BreakerOpen instead of making it while open (a `probe`
        always goes: it is how recovery is noticed between trials)."""
        trial = self._admit(probe)
        try:
            yield
        except Exception as error:
            if self._is_silence(error) and self._silent_since is None:
                self._silent_since = time.monotonic()
            raise
        else:
            self._silent_since = None
        finally:
            if trial:
                self._trial_in_flight = False

    def _admit(self, probe: bool) -> bool:
        """True when this call is the open breaker's trial."""
        if self._silent_since is None or probe:
            return False
        now = time.monotonic()
        if self._trial_in_flight or now - self._last_trial < self._trial_every_s:
            raise BreakerOpen(now - self._silent_since)
        self._last_trial = now
        self._trial_in_flight = True
        return True
