"""Tantivy BM25 on local disk, one index per tenant: title + text, ACL / attribute filters.

One index per tenant because BM25 scores depend on collection statistics (document
frequencies, average length): in a shared index, one tenant's documents would move another
tenant's scores, and the contract says a tenant is never a ranking signal. A tenant's index
is opened on first use and kept among the `max_open` most recently used; its writer exists
only while a write is applied (tantivy's writer holds a lock file and a memory arena).
Within a tenant, statistics are shared by all its documents, whatever their scopes.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from ragline_services.retrieval.documents import (
    Candidate,
    StoredDocument,
    Visibility,
    split_key,
)
from ragline_services.retrieval.stopwords import STOP_WORDS, without_stop_words

_NOT_WORD = re.compile(r"[^\w]+", re.UNICODE)


def sanitise(query: str) -> str:
    """Plain words only: the query grammar's operators and fields are not for callers."""
    return _NOT_WORD.sub(" ", query).lower().strip()


class LexicalIndex(Protocol):
    """Keyword search over the documents, with the same hard filters as vector search."""

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        """Upserts and deletes (by key) at once; searchable when this returns."""

    def search(self, query: str, visibility: Visibility, k: int) -> list[Candidate]: ...

    def count(self, visibility: Visibility | None = None) -> int: ...

    def count_tenant(self, tenant: str) -> int: ...

    def stored(self, keys: list[str]) -> dict[str, dict]:
        """Title, text and version by key, for the keys that exist."""

    def visible_versions(self, visibility: Visibility, keys: list[str]) -> dict[str, int]:
        """Version by key, for the keys that exist and that `visibility` may see."""

    def close(self) -> None: ...


def _schema(tantivy):
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("key", stored=True, tokenizer_name="raw")
    builder.add_text_field("scope", stored=False, tokenizer_name="raw")
    builder.add_text_field("attr", stored=False, tokenizer_name="raw")
    builder.add_text_field("title", stored=True, tokenizer_name="en_stem")
    builder.add_text_field("text", stored=True, tokenizer_name="en_stem")
    builder.add_integer_field("version", stored=True, indexed=False)
    return builder.build()


class _TenantIndex:
    """One tenant's tantivy index."""

    def __init__(self, tantivy, schema, directory: Path, heap_bytes: int) -> None:
        self._tantivy = tantivy
        self.schema = schema
        directory.mkdir(parents=True, exist_ok=True)
        self.index = tantivy.Index(schema, path=str(directory))
        self.heap_bytes = heap_bytes

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        tantivy = self._tantivy
        writer = self.index.writer(heap_size=self.heap_bytes, num_threads=1)
        try:
            for key in deletes:
                writer.delete_documents_by_term("key", key)
            for doc in upserts:
                writer.delete_documents_by_term("key", doc.key)
                writer.add_document(tantivy.Document(
                    key=doc.key, scope=list(doc.scopes), attr=doc.attribute_terms,
                    title=doc.title, text=doc.text, version=doc.version,
                ))  # fmt: skip
            writer.commit()
            writer.wait_merging_threads()  # releases the writer (and its lock) now
        finally:
            del writer
        self.index.reload()

    def _filters(self, visibility: Visibility) -> list:
        tantivy = self._tantivy
        Occur, Query = tantivy.Occur, tantivy.Query
        clauses = [
            (Occur.Must, Query.term_set_query(self.schema, "scope", visibility.allowed_scopes)),
        ]
        for term in visibility.attribute_terms:
            clauses.append((Occur.Must, Query.term_query(self.schema, "attr", term)))
        return clauses

    def search(self, text: str, visibility: Visibility, k: int) -> list[Candidate]:
        tantivy = self._tantivy
        parsed = self.index.parse_query(text, ["title", "text"])
        combined = tantivy.Query.boolean_query(
            [(tantivy.Occur.Must, parsed), *self._filters(visibility)]
        )
        searcher = self.index.searcher()
        hits = searcher.search(combined, k).hits
        return [Candidate(searcher.doc(address)["key"][0], score) for score, address in hits]

    def count(self, visibility: Visibility | None = None) -> int:
        searcher = self.index.searcher()
        if visibility is None:
            return searcher.num_docs
        query = self._tantivy.Query.boolean_query(self._filters(visibility))
        return searcher.search(query, 1, count=True).count

    def visible_versions(self, visibility: Visibility, keys: list[str]) -> dict[str, int]:
        Occur, Query = self._tantivy.Occur, self._tantivy.Query
        scope = Query.term_set_query(self.schema, "scope", visibility.allowed_scopes)
        query = Query.boolean_query(
            [(Occur.Must, Query.term_set_query(self.schema, "key", keys)), (Occur.Must, scope)]
        )
        searcher = self.index.searcher()
        out = {}
        for _, address in searcher.search(query, len(keys)).hits:
            doc = searcher.doc(address)
            out[doc["key"][0]] = doc["version"][0]
        return out

    def stored(self, keys: list[str]) -> dict[str, dict]:
        tantivy = self._tantivy
        searcher = self.index.searcher()
        out = {}
        for key in keys:
            hits = searcher.search(tantivy.Query.term_query(self.schema, "key", key), 1).hits
            if hits:
                doc = searcher.doc(hits[0][1])
                out[key] = {
                    "title": doc["title"][0] if doc["title"] else "",
                    "text": doc["text"][0],
                    "version": doc["version"][0],
                }
        return out


def _tenant_directory(root: Path, tenant: str) -> Path:
    # "t-" keeps tenants named "." or ".." (valid tenant ids) inside the root.
    return root / f"t-{tenant}"


class Bm25Index:
    """Tantivy behind the LexicalIndex interface, one index per tenant."""

    def __init__(
        self, directory: Path, *, heap_bytes: int = 15_000_000, max_open: int = 256
    ) -> None:
        import tantivy

        self._tantivy = tantivy
        self.schema = _schema(tantivy)
        self.directory = directory
        self.heap_bytes = heap_bytes
        self.max_open = max_open
        self.stop_words = STOP_WORDS  # dropped from queries (tools compare other sets)
        self.migrated_from_shared = self._set_aside_a_shared_index(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._open: OrderedDict[str, _TenantIndex] = OrderedDict()
        self._counts: dict[str, int] = {}  # documents per tenant, for the totals
        self._lock = threading.Lock()  # the open-index table
        self._write_lock = threading.Lock()  # one apply at a time (log order)
        self.opened = 0  # tenant indexes opened (first use or after eviction)

    @staticmethod
    def _set_aside_a_shared_index(directory: Path) -> bool:
        """An index of the earlier layout (all tenants in one) is moved aside; the caller
        rebuilds from the write log. Returns whether it did."""
        if not (directory / "meta.json").exists():
            return False
        aside = directory.with_name(f"{directory.name}.shared-{time.strftime('%Y%m%dT%H%M%S')}")
        shutil.move(str(directory), aside)
        return True

    def _tenant(self, tenant: str, create: bool) -> _TenantIndex | None:
        with self._lock:
            found = self._open.get(tenant)
            if found is not None:
                self._open.move_to_end(tenant)
                return found
        path = _tenant_directory(self.directory, tenant)
        if not create and not (path / "meta.json").exists():
            return None
        opened = _TenantIndex(self._tantivy, self.schema, path, self.heap_bytes)
        with self._lock:
            found = self._open.setdefault(tenant, opened)
            self._open.move_to_end(tenant)
            self.opened += found is opened
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # searchers of its last queries stay valid
            return found

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        """Upserts and deletes (by key) in one commit per tenant; searchable on return."""
        by_tenant: dict[str, tuple[list[StoredDocument], list[str]]] = {}
        for doc in upserts:
            by_tenant.setdefault(doc.tenant, ([], []))[0].append(doc)
        for key in deletes:
            by_tenant.setdefault(split_key(key)[0], ([], []))[1].append(key)
        with self._write_lock:
            for tenant, (tenant_upserts, tenant_deletes) in by_tenant.items():
                index = self._tenant(tenant, create=bool(tenant_upserts))
                if index is None:
                    continue  # deletes for a tenant that never wrote: nothing to do
                index.apply(tenant_upserts, tenant_deletes)
                self._counts[tenant] = index.count()

    def search(self, query: str, visibility: Visibility, k: int) -> list[Candidate]:
        text = " ".join(without_stop_words(sanitise(query).split(), self.stop_words))
        if not text:
            return []
        index = self._tenant(visibility.tenant, create=False)
        return [] if index is None else index.search(text, visibility, k)

    def count(self, visibility: Visibility | None = None) -> int:
        if visibility is not None:
            index = self._tenant(visibility.tenant, create=False)
            return 0 if index is None else index.count(visibility)
        return sum(self.count_tenant(t) for t in self.tenants())

    def count_tenant(self, tenant: str) -> int:
        if tenant not in self._counts:
            index = self._tenant(tenant, create=False)
            self._counts[tenant] = 0 if index is None else index.count()
        return self._counts[tenant]

    def tenants(self) -> list[str]:
        return [p.name[2:] for p in self.directory.glob("t-*") if (p / "meta.json").exists()]

    def stored(self, keys: list[str]) -> dict[str, dict]:
        """Title, text and version of documents by key (for `include_text`)."""
        by_tenant: dict[str, list[str]] = {}
        for key in keys:
            by_tenant.setdefault(split_key(key)[0], []).append(key)
        out: dict[str, dict] = {}
        for tenant, tenant_keys in by_tenant.items():
            index = self._tenant(tenant, create=False)
            if index is not None:
                out.update(index.stored(tenant_keys))
        return out

    def visible_versions(self, visibility: Visibility, keys: list[str]) -> dict[str, int]:
        index = self._tenant(visibility.tenant, create=False)
        mine = [k for k in keys if split_key(k)[0] == visibility.tenant]
        return {} if index is None or not mine else index.visible_versions(visibility, mine)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
