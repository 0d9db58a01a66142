"""Domain types of the retrieval service."""

from __future__ import annotations

from dataclasses import dataclass, field

# A document without an acl is visible to every principal of its tenant; it is indexed
# with this scope so one "any of the principal's scopes" filter covers both cases.
PUBLIC_SCOPE = "__public__"
KEY_SEPARATOR = "\x1f"


def doc_key(tenant: str, doc_id: str) -> str:
    """Index-wide identity of a document: the tenant is part of every key."""
    return f"{tenant}{KEY_SEPARATOR}{doc_id}"


def passage_text(title: str, text: str) -> str:
    """What gets embedded for a document (the ingest tool and the service must agree)."""
    return f"{title}. {text}" if title else text


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
    vector: tuple[float, ...]
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

    def to_record(self) -> dict:
        return {
            "tenant": self.tenant, "id": self.id, "title": self.title, "text": self.text,
            "acl": list(self.acl), "attributes": self.attributes, "vector": list(self.vector),
            "version": self.version,
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: dict) -> StoredDocument:
        return cls(
            tenant=record["tenant"], id=record["id"], title=record["title"],
            text=record["text"], acl=tuple(record["acl"]), attributes=dict(record["attributes"]),
            vector=tuple(record["vector"]), version=record["version"],
        )  # fmt: skip


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
    key: str
    score: float
