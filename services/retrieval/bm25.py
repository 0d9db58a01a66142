"""Tantivy BM25 index on local disk: title + text, tenant / ACL / attribute filter terms."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Protocol

from ragline_services.retrieval.documents import Candidate, StoredDocument, Visibility

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

    def close(self) -> None: ...


class Bm25Index:
    """Tantivy behind the LexicalIndex interface."""

    def __init__(self, directory: Path, *, heap_bytes: int = 64_000_000) -> None:
        import tantivy

        self._tantivy = tantivy
        builder = tantivy.SchemaBuilder()
        builder.add_text_field("key", stored=True, tokenizer_name="raw")
        builder.add_text_field("tenant", stored=False, tokenizer_name="raw")
        builder.add_text_field("scope", stored=False, tokenizer_name="raw")
        builder.add_text_field("attr", stored=False, tokenizer_name="raw")
        builder.add_text_field("title", stored=True, tokenizer_name="en_stem")
        builder.add_text_field("text", stored=True, tokenizer_name="en_stem")
        builder.add_integer_field("version", stored=True, indexed=False)
        self.schema = builder.build()
        directory.mkdir(parents=True, exist_ok=True)
        self.index = tantivy.Index(self.schema, path=str(directory))
        self._writer = self.index.writer(heap_size=heap_bytes, num_threads=1)
        self._write_lock = threading.Lock()

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        """Upserts and deletes (by key) in one commit; searchable when this returns."""
        tantivy = self._tantivy
        with self._write_lock:
            for key in deletes:
                self._writer.delete_documents_by_term("key", key)
            for doc in upserts:
                self._writer.delete_documents_by_term("key", doc.key)
                self._writer.add_document(tantivy.Document(
                    key=doc.key, tenant=doc.tenant, scope=list(doc.scopes),
                    attr=doc.attribute_terms, title=doc.title, text=doc.text,
                    version=doc.version,
                ))  # fmt: skip
            self._writer.commit()
        self.index.reload()

    def _filters(self, visibility: Visibility) -> list:
        tantivy = self._tantivy
        Occur, Query = tantivy.Occur, tantivy.Query
        clauses = [
            (Occur.Must, Query.term_query(self.schema, "tenant", visibility.tenant)),
            (Occur.Must, Query.term_set_query(self.schema, "scope", visibility.allowed_scopes)),
        ]
        for term in visibility.attribute_terms:
            clauses.append((Occur.Must, Query.term_query(self.schema, "attr", term)))
        return clauses

    def search(self, query: str, visibility: Visibility, k: int) -> list[Candidate]:
        text = sanitise(query)
        if not text:
            return []
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

    def count_tenant(self, tenant: str) -> int:
        query = self._tantivy.Query.term_query(self.schema, "tenant", tenant)
        return self.index.searcher().search(query, 1, count=True).count

    def stored(self, keys: list[str]) -> dict[str, dict]:
        """Title, text and version of documents by key (for `include_text`)."""
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

    def close(self) -> None:
        """Releases the index writer (and its directory lock)."""
        import gc

        self._writer = None
        gc.collect()
