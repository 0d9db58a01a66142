"""Domain types of the retrieval service."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field

import numpy as np

# A document without an acl is visible to every principal of its tenant; it is indexed
# with this scope so one "any of the principal's scopes" filter covers both cases.
PUBLIC_SCOPE = "__public__"
KEY_SEPARATOR = "\x1f"


def doc_key(tenant: str, doc_id: str) -> str:
    """Index-wide identity of a document: the tenant is part of every key."""
    return f"{tenant}{KEY_SEPARATOR}{doc_id}"


def point_id(key: str) -> int:
    """A stable 63-bit id for a document key: what the engines return for a hit (a
    fast field in BM25, the point id in Qdrant), so a search reads no stored fields until
    it knows the k it returns."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def passage_text(title: str, text: str) -> str:
    """What gets embedded for a document (the ingest tool and the service must agree)."""
    return f"{title}. {text}" if title else text


def encode_vector(values) -> str:
    """A vector as the write log keeps it: base64 of little-endian float32. Lossless for
    the float32 values a request carries, and about 5x smaller and 10x faster to write than
    JSON numbers (the JSON encoding of vectors was most of a write's CPU time)."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(value) -> np.ndarray:
    """Reads both forms: base64 float32, or a JSON list (logs written before the change)."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4").astype(np.float32)
    return np.asarray(value, dtype=np.float32)


def split_key(key: str) -> tuple[str, str]:
    tenant, doc_id = key.split(KEY_SEPARATOR, 1)
    return tenant, doc_id


@dataclass(frozen=True)
class StoredDocument:
    tenant: str
    id: str
    title: str
    text: str
    acl: tuple[str, ...]
    attributes: dict[str, str]
    vector: np.ndarray  # float32, as written (not normalised)
    version: int

    @property
    def key(self) -> str:
        return doc_key(self.tenant, self.id)

    @property
    def scopes(self) -> tuple[str, ...]:
        return self.acl or (PUBLIC_SCOPE,)

    @property
    def attribute_terms(self) -> list[str]:
        return [f"{k}={v}" for k, v in sorted(self.attributes.items())]

    @classmethod
    def from_record(cls, record: dict) -> StoredDocument:
        return cls(
            tenant=record["tenant"],
            id=record["id"],
            title=record["title"],
            text=record["text"],
            acl=tuple(record["acl"]),
            attributes=dict(record["attributes"]),
            vector=decode_vector(record["vector"]),
            version=record["version"],
        )


@dataclass(frozen=True)
class Visibility:
    """Who is searching: a hard filter in every engine."""

    tenant: str
    scopes: frozenset[str] = field(default_factory=frozenset)
    attributes: tuple[tuple[str, str], ...] = ()

    @property
    def allowed_scopes(self) -> list[str]:
        return sorted(self.scopes | {PUBLIC_SCOPE})

    @property
    def attribute_terms(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.attributes]


@dataclass(frozen=True)
class Candidate:
    """A ranked document, by its point id (`point_id(key)`)."""

    pid: int
    score: float

    @property
    def key(self) -> int:
        """What fusion (ragline.ranking) merges the lists on."""
        return self.pid


@dataclass(frozen=True)
class ResolvedHit:
    """What a search returns about one of its final hits, read once the ranking is done."""

    key: str
    version: int
    title: str = ""
    text: str = ""
