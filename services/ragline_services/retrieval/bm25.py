"""Tantivy BM25 on local disk, one index per tenant: title + text, ACL / attribute filters.

One index per tenant because BM25 scores depend on collection statistics (document
frequencies, average length): in a shared index, one tenant's documents would move another
tenant's scores, and the contract says a tenant is never a ranking signal. A tenant's index
is opened on first use and kept among the `max_open` most recently used; its writer exists
only while a write is applied (tantivy's writer holds a lock file and a memory arena).
Within a tenant, statistics are shared by all its documents, whatever their scopes.

A search reads no stored document: hits come back as point ids from a fast field, and
only the k a search finally returns are resolved to key and version by the key map
(`keymap.py`, which also checks their visibility once more); text, when asked, is the
only thing read from stored documents. Visibility filters are constant-score (they never
move a score) term queries that tantivy intersects by skipping, not a term-set bitset built
per query (which cost more than the text query itself at 254k documents).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ragline.files import atomic_write_text, fsync_directory, fsync_tree
from ragline.stopwords import STOP_WORDS
from ragline_services.retrieval import keymap
from ragline_services.retrieval.analysis import ANALYSIS, Analyzer
from ragline_services.retrieval.bm25_params import TANTIVY, Bm25Params
from ragline_services.retrieval.documents import (
    Candidate,
    ResolvedHit,
    StoredDocument,
    Visibility,
    point_id,
    split_key,
)

# A translation goes into the query text only as a plain word (no query-syntax characters).
_PLAIN_TERM = re.compile(r"\w+")

# Which analysis (analysis.py) made a tenant's index: one made by another is re-indexed.
ANALYSIS_FILE = "analysis.json"
# Version of the on-disk layout; an index of another layout is set aside and rebuilt from
# the write log. 1: one index per tenant. 2: adds the point-id and version fast fields.
# 3: adds the key map (keys.sqlite).
LAYOUT = 3
LAYOUT_FILE = "layout.json"


class LexicalIndex(Protocol):
    """Keyword search over the documents, with the same hard filters as vector search."""

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        """Upserts and deletes (by key) at once; searchable when this returns."""

    def search(self, query: str, visibility: Visibility, k: int) -> list[Candidate]: ...

    def count(self, visibility: Visibility | None = None) -> int: ...

    def count_tenant(self, tenant: str) -> int: ...

    def resolve(
        self, visibility: Visibility, pids: list[int], with_text: bool = False
    ) -> dict[int, ResolvedHit]:
        """Key and version (and title + text when asked) of the documents among `pids`
        that exist and that `visibility` may see."""

    def existing(self, tenant: str, pids: list[int]) -> set[int]:
        """Which of `pids` are documents of `tenant`, whatever their scopes."""

    def versions(self, tenant: str, pids: list[int]) -> dict[int, int]:
        """The current version of each of `pids` that is a document of `tenant`."""

    def rewrite(
        self,
        tenants: set[str],
        read_live: Callable[[set[str]], dict[str, list[StoredDocument]]],
    ) -> None:
        """Each tenant's index again with only its live documents: no trace of others."""

    def outdated_tenants(self) -> list[str]:
        """Tenants whose index an earlier analysis made (to be rewritten)."""

    def warm(self) -> None:
        """Loads what analysis needs (jieba's dictionary) before the first query."""

    def close(self) -> None: ...


def _schema(tantivy):
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("key", stored=True, tokenizer_name="raw")
    builder.add_integer_field("pid", stored=False, indexed=True, fast=True)
    builder.add_text_field("scope", stored=False, tokenizer_name="raw")
    builder.add_text_field("attr", stored=False, tokenizer_name="raw")
    builder.add_text_field("title", stored=True, tokenizer_name="en_stem")
    builder.add_text_field("text", stored=True, tokenizer_name="en_stem")
    builder.add_integer_field("version", stored=True, indexed=False, fast=True)
    return builder.build()


class _TenantIndex:
    """One tenant's tantivy index."""

    def __init__(
        self, tantivy, schema, directory: Path, heap_bytes: int, analyzer: Analyzer
    ) -> None:
        self._tantivy = tantivy
        self.schema = schema
        self.analyzer = analyzer
        new = not (directory / "meta.json").exists()
        directory.mkdir(parents=True, exist_ok=True)
        self.index = tantivy.Index(schema, path=str(directory))
        if new:
            atomic_write_text(directory / ANALYSIS_FILE, json.dumps({"analysis": ANALYSIS}))
        self.heap_bytes = heap_bytes

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        tantivy = self._tantivy
        writer = self.index.writer(heap_size=self.heap_bytes, num_threads=1)
        try:
            for key in deletes:
                writer.delete_documents_by_term("key", key)
            for doc in upserts:
                writer.delete_documents_by_term("key", doc.key)
                document = tantivy.Document(
                    key=doc.key,
                    pid=point_id(doc.key),
                    scope=list(doc.scopes),
                    attr=doc.attribute_terms,
                    version=doc.version,
                )
                # Stored as written, indexed as analysed (Chinese segmented by jieba).
                analyse = self.analyzer.pre_tokenized
                document.add_pre_tokenized_text("title", analyse(tantivy, doc.title))
                document.add_pre_tokenized_text("text", analyse(tantivy, doc.text))
                writer.add_document(document)
            writer.commit()
            writer.wait_merging_threads()  # releases the writer (and its lock) now
        finally:
            del writer
        self.index.reload()

    def _filter(self, visibility: Visibility):
        """Any of the allowed scopes, and every attribute: constant score 0, so it only
        selects. Term queries (a union when several scopes), which tantivy intersects by
        skipping; a term-set query would build a bitset of every match per query."""
        Occur, Query = self._tantivy.Occur, self._tantivy.Query
        scopes = [Query.term_query(self.schema, "scope", s) for s in visibility.allowed_scopes]
        scope = (
            scopes[0]
            if len(scopes) == 1
            else Query.boolean_query([(Occur.Should, q) for q in scopes])
        )
        clauses = [(Occur.Must, scope)]
        for term in visibility.attribute_terms:
            clauses.append((Occur.Must, Query.term_query(self.schema, "attr", term)))
        selected = scope if len(clauses) == 1 else Query.boolean_query(clauses)
        return Query.const_score_query(selected, 0.0)

    def search(
        self, text: str, visibility: Visibility, k: int, params: Bm25Params = TANTIVY
    ) -> list[Candidate]:
        tantivy = self._tantivy
        parsed = self.index.parse_query(text, ["title", "text"])
        combined = tantivy.Query.boolean_query(
            [(tantivy.Occur.Must, parsed), (tantivy.Occur.Must, self._filter(visibility))]
        )
        searcher = self.index.searcher()
        hits = searcher.search(combined, params.pool(k), count=False).hits
        if not params.native:
            # Tantivy's k1 and b are fixed: its candidates scored again (bm25_params.py).
            rescored = [
                (params.rescore(combined.explain(searcher, address).to_json()), address)
                for _, address in hits
            ]
            hits = sorted(rescored, key=lambda hit: -hit[0])[:k]
        pids = searcher.fast_field_values("pid", [address for _, address in hits])
        return [Candidate(pid, score) for (score, _), pid in zip(hits, pids, strict=True)]

    def count(self, visibility: Visibility | None = None) -> int:
        searcher = self.index.searcher()
        if visibility is None:
            return searcher.num_docs
        return searcher.search(self._filter(visibility), 1, count=True).count

    def stored(self, pids: list[int]) -> dict[int, ResolvedHit]:
        """Key, version, title and text of the documents among `pids`, from their stored
        documents (what `include_text` needs; visibility is the caller's check)."""
        query = self._tantivy.Query.term_set_query(self.schema, "pid", pids)
        searcher = self.index.searcher()
        out = {}
        for _, address in searcher.search(query, len(pids), count=False).hits:
            doc = searcher.doc(address)
            key = doc["key"][0]
            out[point_id(key)] = ResolvedHit(
                key=key,
                version=doc["version"][0],
                title=doc["title"][0] if doc["title"] else "",
                text=doc["text"][0],
            )
        return out


def _tenant_directory(root: Path, tenant: str) -> Path:
    # "t-" keeps tenants named "." or ".." (valid tenant ids) inside the root.
    return root / f"t-{tenant}"


class Bm25Index:
    """Tantivy behind the LexicalIndex interface, one index per tenant."""

    def __init__(
        self,
        directory: Path,
        *,
        heap_bytes: int = 15_000_000,
        max_open: int = 256,
        analyzer: Analyzer | None = None,
        translation_weight: float = 0.5,
        params: Bm25Params = TANTIVY,
    ) -> None:
        import tantivy

        self._tantivy = tantivy
        self.analyzer = analyzer or Analyzer()
        self.schema = _schema(tantivy)
        self.directory = directory
        self.heap_bytes = heap_bytes
        self.max_open = max_open
        self.stop_words = STOP_WORDS  # dropped from queries (tools compare other sets)
        # Weight of a query word's translation into the other language (0: none).
        self.translation_weight = translation_weight
        self.params = params  # k1 and b (Tantivy's own, or its candidates scored again)
        self.migrated = self._set_aside_an_old_layout(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.keys = keymap.KeyMap(directory / keymap.FILE)
        atomic_write_text(directory / LAYOUT_FILE, json.dumps({"layout": LAYOUT}))
        self._open: OrderedDict[str, _TenantIndex] = OrderedDict()
        self._counts: dict[str, int] = {}  # documents per tenant, for the totals
        self._lock = threading.Lock()  # the open-index table
        self._write_lock = threading.Lock()  # one apply at a time (log order)
        self.opened = 0  # tenant indexes opened (first use or after eviction)

    @staticmethod
    def _set_aside_an_old_layout(directory: Path) -> bool:
        """An index of an earlier layout (all tenants in one, without the fast fields or
        the key map), or one whose key map is gone, is moved aside; the caller rebuilds
        from the write log. Returns whether it did."""
        if not directory.exists() or not any(directory.iterdir()):
            return False
        marker = directory / LAYOUT_FILE
        layout = json.loads(marker.read_text())["layout"] if marker.exists() else 1
        keys_lost = any(directory.glob("t-*/meta.json")) and not (directory / keymap.FILE).exists()
        if layout == LAYOUT and not (directory / "meta.json").exists() and not keys_lost:
            return False
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = directory.with_name(f"{directory.name}.layout{layout}-{stamp}")
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
        opened = _TenantIndex(self._tantivy, self.schema, path, self.heap_bytes, self.analyzer)
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
                # The map first: it is what hides a hit, so a narrowed acl or a delete
                # holds before any engine applies it (see keymap.py).
                self.keys.apply(tenant, tenant_upserts, tenant_deletes)
                index.apply(tenant_upserts, tenant_deletes)
                self._counts[tenant] = index.count()

    def rewrite(
        self,
        tenants: set[str],
        read_live: Callable[[set[str]], dict[str, list[StoredDocument]]],
    ) -> None:
        """Replaces each tenant's index by one holding only its live documents, as
        `read_live` reads them from the write log: tantivy keeps the stored text of a
        deleted or overwritten document in its segment until it merges it, which a small
        index may never do. Applies wait meanwhile (the log read under the lock holds at
        least what they applied); searches keep the old index until the swap."""
        with self._write_lock:
            for tenant, documents in read_live(tenants).items():
                self._rewrite_one(tenant, documents)

    def _rewrite_one(self, tenant: str, live: list[StoredDocument]) -> None:
        path = _tenant_directory(self.directory, tenant)
        if not path.exists():
            return
        # Staged outside the tenants' "t-" names: "acme.rewrite" and "acme.old" are tenants.
        fresh, aside = (self.directory / stage / path.name for stage in (".rewrite", ".old"))
        fresh.parent.mkdir(exist_ok=True)
        aside.parent.mkdir(exist_ok=True)
        shutil.rmtree(fresh, ignore_errors=True)
        index = _TenantIndex(self._tantivy, self.schema, fresh, self.heap_bytes, self.analyzer)
        index.apply(live, [])
        del index
        fsync_tree(fresh)
        shutil.rmtree(aside, ignore_errors=True)
        with self._lock:
            self._open.pop(tenant, None)
            os.replace(path, aside)
            os.replace(fresh, path)
        fsync_directory(self.directory)
        shutil.rmtree(aside, ignore_errors=True)
        reopened = self._tenant(tenant, create=False)
        self._counts[tenant] = reopened.count() if reopened is not None else 0

    def search(self, query: str, visibility: Visibility, k: int) -> list[Candidate]:
        written = self.analyzer.query_words(query, self.stop_words)
        text = " ".join(written)
        if not text:
            return []
        if self.translation_weight > 0:
            # The other language's words, each weighing less than one the query wrote.
            text += "".join(
                f" {word}^{self.translation_weight:g}"
                for word in self.analyzer.translations(query, written)
                if _PLAIN_TERM.fullmatch(word)
            )
        index = self._tenant(visibility.tenant, create=False)
        return [] if index is None else index.search(text, visibility, k, self.params)

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

    def warm(self) -> None:
        self.analyzer.warm()

    def outdated_tenants(self) -> list[str]:
        """Tenants whose index another analysis made (re-indexed by `rewrite`)."""
        outdated = []
        for tenant in self.tenants():
            marker = _tenant_directory(self.directory, tenant) / ANALYSIS_FILE
            made_by = json.loads(marker.read_text())["analysis"] if marker.exists() else 1
            if made_by != ANALYSIS:
                outdated.append(tenant)
        return outdated

    def tenants(self) -> list[str]:
        return [p.name[2:] for p in self.directory.glob("t-*") if (p / "meta.json").exists()]

    def resolve(
        self, visibility: Visibility, pids: list[int], with_text: bool = False
    ) -> dict[int, ResolvedHit]:
        visible = {
            pid: entry
            for pid, entry in self.keys.lookup(visibility.tenant, pids).items()
            if entry.visible_to(visibility)
        }
        if not with_text:
            return {pid: ResolvedHit(e.key, e.version) for pid, e in visible.items()}
        index = self._tenant(visibility.tenant, create=False)
        if index is None or not visible:
            return {}
        # Key, version and text together from the stored document (a consistent triple
        # while an update is half applied); the map decided what may be seen.
        return {pid: hit for pid, hit in index.stored(list(visible)).items() if pid in visible}

    def existing(self, tenant: str, pids: list[int]) -> set[int]:
        """Which of `pids` are documents of `tenant`, whatever their scopes."""
        return set(self.keys.lookup(tenant, pids))

    def versions(self, tenant: str, pids: list[int]) -> dict[int, int]:
        """The current version of each of `pids` that is a document of `tenant`."""
        return {pid: e.version for pid, e in self.keys.lookup(tenant, pids).items()}

    def close(self) -> None:
        with self._lock:
            self._open.clear()
        self.keys.close()
