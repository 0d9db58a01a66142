"""One cache backend for every service that caches: in-process when embedded, Redis when
several replicas must share it.

Two implementations behind `CacheBackend`:
- `MemoryCache`: a bounded LRU with a TTL per entry (cachetools' TLRUCache), bounded in
  bytes, for one process (`ragline up`, tests);
- `RedisCache`: `redis.asyncio` against a Redis server (RAGLINE_<SERVICE>_CACHE_URL), so
  replicas see each other's entries. Every call has a timeout.

Redis credentials and TLS come from `RedisAccess` (RAGLINE_REDIS_*: an ACL user and its
password, a CA for `rediss://`), never from the URL, which logs and error details show.

Values are bytes; what they mean is the caller's business (generation's KV store keeps
JSON entries, the orchestrator's caches serialized results). Keys are namespaced by the
caller. A cache is an optimisation: a backend that fails raises `Unavailable`, and callers
treat that as a miss (they log it and carry on), never as the request's failure.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from cachetools import TLRUCache
from pydantic_settings import SettingsConfigDict

from ragline.breaker import Breaker, BreakerOpen
from ragline.config import ConfigError, EmptyMeansUnset
from ragline.errors import Unavailable

T = TypeVar("T")


class RedisAccess(EmptyMeansUnset):
    """How a service signs in to its Redis (prefix `RAGLINE_REDIS_`): kept out of the cache
    URL so that no log line or error detail carries the password."""

    model_config = SettingsConfigDict(env_prefix="RAGLINE_REDIS_", extra="ignore")

    # An ACL user (Redis 6+) and its password; a password alone signs in as `default`.
    username: str = ""
    password: str = ""
    # TLS (a `rediss://` URL): the CA of the server's certificate, and a client certificate
    # where the server asks for one (tls-auth-clients).
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def client_arguments(self, url: str) -> dict[str, Any]:
        """redis-py's arguments beside the URL."""
        parsed = urllib.parse.urlsplit(url)
        if parsed.password:
            raise ConfigError(
                "a cache URL holds a password, which logs would show: move it to "
                "RAGLINE_REDIS_PASSWORD (and the user to RAGLINE_REDIS_USERNAME)"
            )
        arguments: dict[str, Any] = {}
        if self.username:
            arguments["username"] = self.username
        if self.password:
            arguments["password"] = self.password
        if parsed.scheme == "rediss":
            arguments["ssl_ca_certs"] = str(self.ca_file) if self.ca_file else None
            if self.cert_file and self.key_file:
                arguments["ssl_certfile"] = str(self.cert_file)
                arguments["ssl_keyfile"] = str(self.key_file)
        elif self.ca_file or self.cert_file:
            raise ConfigError(
                "RAGLINE_REDIS_CA_FILE / _CERT_FILE are set but the cache URL is not "
                "rediss://: the connection would not use them"
            )
        return arguments


class CacheBackend(Protocol):
    name: str  # "memory" | "redis": for logs and reports

    async def get(self, key: str) -> bytes | None:
        """The value, or None when absent or expired."""

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        """Stores `value` for `ttl_s` seconds (replacing any previous value and TTL)."""

    async def delete(self, *keys: str) -> None: ...

    async def incr(self, key: str, ttl_s: float) -> int:
        """Adds one to a counter and returns it. The counter's TTL starts at its first
        increment and is not extended by later ones: it counts within a fixed window."""

    async def keys(self, prefix: str) -> list[str]:
        """Every live key that starts with `prefix` (for small key sets: an index, not
        a whole cache)."""

    async def close(self) -> None: ...


@dataclass
class _Item:
    value: bytes | int
    expires_at: float


def _item_size(item: _Item) -> int:
    # Entry overhead included, so a flood of tiny entries is bounded too.
    return (len(item.value) if isinstance(item.value, bytes) else 8) + 64


class MemoryCache:
    """Bounded in-process LRU with per-entry TTLs. Not shared across processes."""

    name = "memory"

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self._entries: TLRUCache[str, _Item] = TLRUCache(
            maxsize=max_bytes,
            ttu=lambda _key, item, _now: item.expires_at,
            timer=time.monotonic,
            getsizeof=_item_size,
        )

    def _live(self, key: str) -> _Item | None:
        return self._entries.get(key)

    async def get(self, key: str) -> bytes | None:
        item = self._live(key)
        return item.value if item is not None and isinstance(item.value, bytes) else None

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        item = _Item(bytes(value), time.monotonic() + ttl_s)
        if _item_size(item) > self._entries.maxsize:
            self._entries.pop(key, None)  # larger than the whole cache: not kept
            return
        self._entries[key] = item

    async def delete(self, *keys: str) -> None:
        for key in keys:
            self._entries.pop(key, None)

    async def incr(self, key: str, ttl_s: float) -> int:
        item = self._live(key)
        if item is None or not isinstance(item.value, int):
            item = _Item(0, time.monotonic() + ttl_s)
        count = int(item.value) + 1
        self._entries[key] = _Item(count, item.expires_at)
        return count

    async def keys(self, prefix: str) -> list[str]:
        self._entries.expire()
        return [key for key in list(self._entries) if key.startswith(prefix)]

    async def close(self) -> None:
        self._entries.clear()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisCache:
    """A Redis server shared by replicas. Every call is bounded by `timeout_s`."""

    name = "redis"

    def __init__(
        self, url: str, *, timeout_s: float = 0.5, access: RedisAccess | None = None
    ) -> None:
        import redis.asyncio as redis  # only when configured

        self.url = url
        arguments = (access or RedisAccess()).client_arguments(url)
        self._errors = (redis.RedisError, OSError)
        # A silent Redis would cost every lookup its whole timeout, and a request makes
        # several: while it does not answer, lookups are misses at once (ragline/breaker.py).
        silence = (redis.TimeoutError, redis.ConnectionError, OSError, TimeoutError)
        self._breaker = Breaker(lambda error: isinstance(error, silence))
        self._client = redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
            **arguments,
        )

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        try:
            with self._breaker.attempt():
                return await call
        except BreakerOpen as error:
            if isinstance(call, Coroutine):
                call.close()  # never sent
            raise Unavailable(f"cache {what} on {self.url} skipped: {error}") from None
        except self._errors as error:
            raise Unavailable(f"cache {what} on {self.url} failed: {error}") from error

    async def get(self, key: str) -> bytes | None:
        value = await self._call("get", self._client.get(key))
        return cast("bytes | None", value)  # the client does not decode responses

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        await self._call("set", self._client.set(key, value, px=max(int(ttl_s * 1000), 1)))

    async def delete(self, *keys: str) -> None:
        if keys:
            await self._call("delete", self._client.delete(*keys))

    async def incr(self, key: str, ttl_s: float) -> int:
        async def counted() -> int:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                # NX: the window starts at the first increment and later ones keep it.
                pipe.pexpire(key, max(int(ttl_s * 1000), 1), nx=True)
                count, _ = await pipe.execute()
            return int(count)

        return await self._call("incr", counted())

    async def keys(self, prefix: str) -> list[str]:
        async def scanned() -> list[str]:
            match = _glob_escape(prefix) + "*"
            return [key.decode() async for key in self._client.scan_iter(match=match, count=500)]

        return await self._call("scan", scanned())

    async def ping(self) -> None:
        try:
            with self._breaker.attempt(probe=True):
                await self._client.ping()
        except self._errors as error:
            raise Unavailable(f"cache ping on {self.url} failed: {error}") from error

    async def close(self) -> None:
        await self._client.aclose()


def open_cache(
    url: str = "",
    *,
    max_bytes: int = 64 << 20,
    timeout_s: float = 0.5,
    access: RedisAccess | None = None,
) -> CacheBackend:
    """Redis when `url` is set (redis:// or rediss://host:port/db; credentials from
    `access`, default RAGLINE_REDIS_*), else an in-process LRU."""
    if url:
        return RedisCache(url, timeout_s=timeout_s, access=access)
    return MemoryCache(max_bytes)
