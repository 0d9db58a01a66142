"""Client-token verification keys from a JWKS (RFC 7517): an identity provider's endpoint
(`https://idp/.well-known/jwks.json`) or a mounted file (`file:///etc/ragline/jwks.json`).

A token names its key by `kid`; a rotation publishes the new key before signing with it.
The keys are fetched on a thread of their own, at start, every `refresh_s`, and soon after a
token names a key the set does not hold (at most every `MIN_REFETCH_S`), so verifying a
token never waits on the network: an unknown key id is refused at once and known moments
later. A fetch that fails keeps the last good set. Symmetric (`oct`) keys are never taken
from a key set: a published key must not also sign.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import jwt

log = structlog.get_logger("ragline.auth.jwks")

# The soonest a token naming an unknown key triggers another fetch (tokens are free to
# send; the identity provider's endpoint is not).
MIN_REFETCH_S = 10.0
FETCH_TIMEOUT_S = 5.0


class JwksKeys:
    """The current keys of one key set, by key id, refreshed in the background."""

    def __init__(self, url: str, *, refresh_s: float = 300.0, algorithms: list[str]) -> None:
        self.url = url
        self.refresh_s = refresh_s
        self._algorithms = set(algorithms)
        self._keys: dict[str, jwt.PyJWK] = {}
        self.fetched_at: float | None = None
        self.last_error = ""
        self._wake = threading.Event()
        self._first = threading.Event()
        self._stopped = threading.Event()
        self._last_fetch = 0.0
        self._thread = threading.Thread(target=self._run, name="jwks", daemon=True)
        self._thread.start()

    def wait_first_fetch(self, timeout_s: float) -> bool:
        """Blocks until the first fetch ended (either way); False on timeout."""
        return self._first.wait(timeout_s)

    def key(self, kid: str) -> jwt.PyJWK | None:
        """The key named `kid`, or None (and a fetch soon)."""
        found = self._keys.get(kid)
        if found is None:
            self._wake.set()
        return found

    def known_ids(self) -> list[str]:
        return sorted(self._keys)

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            wait = max(self._last_fetch + MIN_REFETCH_S - time.monotonic(), 0.0)
            if self.fetched_at is not None and wait:
                # rate limit: a woken fetch waits out the minimum gap first
                if self._stopped.wait(wait):
                    return
            self._fetch()
            self._first.set()
            self._wake.wait(self.refresh_s)
            self._wake.clear()

    def _fetch(self) -> None:
        import jwt

        self._last_fetch = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=FETCH_TIMEOUT_S) as reply:
                document = json.loads(reply.read())
            keys = {}
            for entry in document.get("keys", []):
                if entry.get("kty") == "oct" or not entry.get("kid"):
                    continue
                if entry.get("use", "sig") != "sig":
                    continue
                key = jwt.PyJWK.from_dict(entry)
                if key.algorithm_name in self._algorithms:
                    keys[entry["kid"]] = key
        except (OSError, ValueError, jwt.PyJWTError, AttributeError) as error:
            self.last_error = str(error)
            log.warning("auth.jwks_fetch_failed", url=self.url, error=str(error))
            return
        changed = set(keys) != set(self._keys)
        self._keys = keys
        self.fetched_at = time.time()
        self.last_error = ""
        if changed:
            log.info("auth.jwks_keys", url=self.url, kids=sorted(keys))
