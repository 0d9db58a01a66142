"""`ragline ingest PATH`: load documents into the retrieval service.

Reads SQuAD JSON (every paragraph becomes a document) or JSONL (`{id, title, text, tenant,
acl, attributes}` per line), checks every record, embeds the good ones through the embedding
service in batches and upserts them with their vectors. Bad records are reported (line and
reason) and skipped; the good ones still go in. Up to three batches are in flight at once
(one embedded, as several Embed calls that the service runs side by side, while the one
before it is written and prepared); progress is checkpointed
in order, after every acknowledged batch, so an interrupted run resumes where it stopped.

When a rerank service is given, every acknowledged batch is also sent to its `Prepare`, so
that the documents' token vectors exist before the first question about them. That is an
optimisation, never a condition: when rerank does not answer, ingest says so once and goes on.

One model run per passage: rerank's token model is an embedding model, and its run gives a
passage's embedding as well as its token vectors. The run starts by asking the embedding
service which model it runs (one short Embed); batches are then sent to `Prepare` first
with `return_embeddings`, and when rerank names the same model version the vectors it
returns are what is written: the Embed call is skipped, halving the model work of an
ingest. Another model, or any failure, falls back to Embed for the rest of the run.

Why one file of this length: each input format's reader and the pipeline that checks,
embeds and writes share the record type and the one progress report.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ragline import deadlines, identity
from ragline.clients import ChannelPool, ServiceClient
from ragline.files import atomic_write_text
from ragline.retry import PATIENT_POLICY
from ragline.v1 import common_pb2
from ragline.validation import violations
from ragline_app.datasets import load_squad

# Every batch (embed, then upsert, retries included) must finish within this.
BATCH_TIMEOUT_S = 120.0

# Texts per Embed (and Prepare) call: a batch is embedded as several calls at once, so the
# service's runners stay busy while each of its model runs stays short (a question that
# arrives meanwhile waits for one such run, not for a whole batch of passages).
EMBED_CHUNK = 8


@dataclass
class IngestStats:
    """How the passages of a run were embedded."""

    embedded: int = 0  # by the embedding service
    embedded_by_rerank: int = 0  # taken from rerank's token pass (one model run each)


@dataclass
class Record:
    number: int  # 1-based position in the file (line for JSONL)
    tenant: str
    id: str
    title: str
    text: str
    acl: list[str] = field(default_factory=list)
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass
class BadRecord:
    number: int
    reason: str


def read_records(path: Path, default_tenant: str) -> Iterator[Record | BadRecord]:
    if path.suffix == ".json":
        passages, _ = load_squad(path)
        for number, passage in enumerate(passages, start=1):
            yield Record(number, default_tenant, passage.id, passage.title, passage.text)
        return
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except ValueError as error:
                yield BadRecord(number, f"invalid JSON: {error}")
                continue
            if not isinstance(raw, dict):
                yield BadRecord(number, "not a JSON object")
                continue
            yield check(number, raw, default_tenant)


def check(number: int, raw: dict, default_tenant: str) -> Record | BadRecord:
    """A record, or why it cannot be one: the contract's own rules on `Document` (the
    limits live in the .proto file only), the tenant rule, and JSON types."""
    tenant = str(raw.get("tenant") or default_tenant)
    doc_id, text = raw.get("id"), raw.get("text")
    title = raw.get("title") or ""
    acl = raw.get("acl") or []
    attributes = raw.get("attributes") or {}
    problems = []
    if not identity.is_tenant(tenant):
        problems.append(f"tenant {tenant!r} must be {identity.TENANT_RULE}")
    if not isinstance(doc_id, str | int):
        problems.append("id must be a string")
    if not isinstance(text, str) or not text.strip():
        problems.append("text is missing or empty")
        text = ""
    if not isinstance(title, str):
        problems.append("title must be a string")
    if not isinstance(acl, list) or not all(
        isinstance(s, str) and identity.is_name(s) for s in acl
    ):
        problems.append(f"acl must be a list of scopes ({identity.NAME_RULE})")
    if not isinstance(attributes, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in attributes.items()
    ):
        problems.append("attributes must map strings to strings")
    if not problems:
        document = common_pb2.Document(
            id=str(doc_id), title=title, text=text, acl=acl, attributes=attributes
        )
        problems.extend(f"{v.field}: {v.description}" for v in violations(document))
    if problems:
        return BadRecord(number, "; ".join(problems))
    return Record(number, tenant, str(doc_id), title, text, list(acl), dict(attributes))


def writer(records) -> identity.Caller:
    """Who writes a batch: its tenant, with the write scope and every scope the batch's
    acls name (with authentication on, the token must hold them: SCOPE_NOT_HELD else)."""
    scopes = {scope for record in records for scope in record.acl}
    return identity.Caller(records[0].tenant, scopes=frozenset({identity.WRITE_SCOPE, *scopes}))


def input_identity(path: Path, tenant: str, token: str = "") -> dict:
    """What a resume point belongs to: this file as it is now (its resolved path, size and
    modification time) read into this tenant (the default tenant, and the token that
    decides the caller's tenant under authentication; a digest of it, never the token)."""
    stat = path.stat()
    return {
        "file": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tenant": tenant,
        "token": hashlib.sha256(token.encode()).hexdigest()[:16] if token else "",
    }


class Checkpoint:
    """The highest record number acknowledged (the resume point), for one input: a file as
    it was, read into one tenant. A checkpoint written for another tenant, or for the file
    before it changed, is never resumed from: `discarded` says why it was not."""

    def __init__(self, path: Path, source: dict | None = None) -> None:
        self.path = path
        self.source = source
        self.done = 0
        self.discarded = ""
        if path.exists():
            found = json.loads(path.read_text())
            if source is None or found.get("source") == source:
                self.done = found["done"]
            else:
                self.discarded = _changed(found.get("source") or {}, source)

    @classmethod
    def for_input(cls, directory: Path, path: Path, tenant: str, token: str = "") -> Checkpoint:
        """The checkpoint of `path` read into `tenant` (one file per input and tenant)."""
        source = input_identity(path, tenant, token)
        key = hashlib.sha256(f"{source['file']}\0{tenant}\0{source['token']}".encode())
        return cls(directory / f"{path.name}-{key.hexdigest()[:16]}.json", source)

    def save(self, done: int) -> None:
        self.done = max(self.done, done)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"done": self.done, "source": self.source}))


def _changed(before: dict, now: dict) -> str:
    """Why a checkpoint belongs to another input."""
    if not before:
        return "it records no file identity (written by an older ragline)"
    what = [
        f"{name} {before.get(name)} -> {now.get(name)}"
        for name in ("tenant", "size", "mtime_ns")
        if before.get(name) != now.get(name)
    ]
    return "the file changed since it was written (" + ", ".join(what) + ")"


def tenant_batches(
    records: Iterable[Record], batch_size: int
) -> Iterator[tuple[list[Record], bool]]:
    """The records grouped by tenant, each group as soon as it holds `batch_size` (the rest
    at the end), with whether no other group is still waiting: then every record read so
    far is in a batch handed out."""
    pending: dict[str, list[Record]] = {}
    for record in records:
        batch = pending.setdefault(record.tenant, [])
        batch.append(record)
        if len(batch) >= batch_size:
            yield pending.pop(record.tenant), not pending
    for tenant in list(pending):
        yield pending.pop(tenant), not pending


async def ingest(
    path: Path,
    *,
    retrieval_addr: str,
    embedding_addr: str,
    default_tenant: str,
    batch_size: int = 64,
    checkpoint: Checkpoint,
    window: int = 3,
    progress=None,
    rerank_addr: str | None = None,
    notice=None,
    token: str | None = None,
    one_pass: bool = True,
    stats: IngestStats | None = None,
) -> tuple[int, list[BadRecord]]:
    """Returns (documents written, bad records). `notice(text)` hears about rerank
    preparation being given up. `token`: a client token (authentication on); every record
    must then belong to the token's tenant. `one_pass`: take passages' vectors from rerank's
    token pass when it runs the embedding service's model; `stats` is filled as it goes."""
    ingestion = Ingestion(
        path,
        retrieval_addr=retrieval_addr,
        embedding_addr=embedding_addr,
        default_tenant=default_tenant,
        checkpoint=checkpoint,
        progress=progress,
        rerank_addr=rerank_addr,
        notice=notice,
        token=token,
        one_pass=one_pass,
        stats=stats if stats is not None else IngestStats(),
    )
    return await ingestion.run(batch_size, window)


class Ingestion:
    """One file ingested: its good records read past the checkpoint, grouped by tenant,
    embedded (by the embedding service, or by rerank's token pass when that runs the same
    model), written to retrieval, and their token vectors prepared, up to `window` batches
    in flight. Batches are settled in order, so the checkpoint only ever covers
    acknowledged ones."""

    def __init__(
        self,
        path: Path,
        *,
        retrieval_addr: str,
        embedding_addr: str,
        default_tenant: str,
        checkpoint: Checkpoint,
        progress,
        rerank_addr: str | None,
        notice,
        token: str | None,
        one_pass: bool,
        stats: IngestStats,
    ) -> None:
        from ragline.v1 import embedding_pb2_grpc

        self.path, self.default_tenant = path, default_tenant
        self.retrieval_addr, self.token = retrieval_addr, token
        self.checkpoint, self.progress = checkpoint, progress
        self.one_pass, self.stats = one_pass, stats
        self.pool = ChannelPool()
        self.embedder = ServiceClient(
            embedding_pb2_grpc.EmbeddingServiceStub, embedding_addr, pool=self.pool, token=token
        )
        self.preparer = (
            RerankPreparer(rerank_addr, self.pool, notice, token) if rerank_addr else None
        )
        self.bad: list[BadRecord] = []
        self.written = 0
        self.embedding_version = ""  # the model version the embedding service last answered
        self.last_number = checkpoint.done  # of the last record read
        # Batches in flight: (its task, its records, whether all read so far is in one).
        self._in_flight: deque[tuple[asyncio.Task, list[Record], bool]] = deque()

    async def run(self, batch_size: int, window: int) -> tuple[int, list[BadRecord]]:
        """(documents written, bad records)."""
        try:
            if self.one_pass and self.preparer is not None:
                with deadlines.deadline_scope(BATCH_TIMEOUT_S):
                    await self._embed(["which model"])  # learns embedding_version
            # While one batch is embedded, the one before it is written and its token
            # vectors prepared (different services, different cores).
            for records, drained in tenant_batches(self._good_records(), batch_size):
                task = asyncio.ensure_future(self._flush(records))
                self._in_flight.append((task, records, drained))
                if len(self._in_flight) >= window:
                    await self._settle_oldest()
            while self._in_flight:
                await self._settle_oldest()
            self.checkpoint.save(self.last_number)
        finally:
            for task, _, _ in self._in_flight:
                task.cancel()
            await asyncio.gather(*(task for task, _, _ in self._in_flight), return_exceptions=True)
            await self.pool.close()
        return self.written, self.bad

    def _good_records(self) -> Iterator[Record]:
        for item in read_records(self.path, self.default_tenant):
            self.last_number = item.number
            if self.progress is not None:
                self.progress(item.number)
            if item.number <= self.checkpoint.done:
                continue
            if isinstance(item, BadRecord):
                self.bad.append(item)
                continue
            yield item

    async def _settle_oldest(self) -> None:
        task, records, drained = self._in_flight.popleft()
        await task
        if drained:  # everything up to this batch's last record is acknowledged
            self.checkpoint.save(records[-1].number)

    def _rerank_embeds(self) -> bool:
        preparer = self.preparer
        return bool(
            self.one_pass
            and preparer is not None
            and not preparer.given_up
            and preparer.offers_embeddings
            and self.embedding_version
            and preparer.model_version in ("", self.embedding_version)  # "": not known yet
        )

    async def _embed(self, texts: list[str]) -> list[tuple]:
        """(vector, model version) per text, from the embedding service."""
        from ragline.v1 import embedding_pb2

        replies = await asyncio.gather(
            *(
                self.embedder.unary(
                    "Embed",
                    embedding_pb2.EmbedRequest(
                        texts=texts[start : start + EMBED_CHUNK],
                        input_type=embedding_pb2.INPUT_TYPE_PASSAGE,
                        priority=embedding_pb2.PRIORITY_BULK,  # questions go first
                    ),
                    retry=PATIENT_POLICY,
                )
                for start in range(0, len(texts), EMBED_CHUNK)
            )
        )
        self.embedding_version = replies[-1].model_version
        # each call's own version: a rolling restart may change the model mid-batch
        return [(e.values, reply.model_version) for reply in replies for e in reply.embeddings]

    async def _flush(self, records: list[Record]) -> None:
        from ragline_services.retrieval.documents import passage_text

        with deadlines.deadline_scope(BATCH_TIMEOUT_S):
            vectors = prepared = None
            if self._rerank_embeds():
                assert self.preparer is not None
                prepared = await self.preparer.prepare(records, embeddings=True)
                # Another model's (rerank's own setting): its token vectors are kept, the
                # vectors written are the embedding service's.
                if prepared is not None and all(v == self.embedding_version for _, v in prepared):
                    vectors = prepared
                    self.stats.embedded_by_rerank += len(records)
            if vectors is None:
                vectors = await self._embed([passage_text(r.title, r.text) for r in records])
                self.stats.embedded += len(records)
            await self._upsert(records, vectors)
        self.written += len(records)
        if self.preparer is not None and prepared is None:
            await self.preparer.prepare(records)

    async def _upsert(self, records: list[Record], vectors: list[tuple]) -> None:
        from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc

        request = retrieval_pb2.UpsertRequest()
        for record, (values, version) in zip(records, vectors, strict=True):
            request.documents.add(
                id=record.id,
                title=record.title,
                text=record.text,
                acl=record.acl,
                attributes=record.attributes,
                vector=values,
                vector_model_version=version,
            )
        retrieval = ServiceClient(
            retrieval_pb2_grpc.RetrievalServiceStub,
            self.retrieval_addr,
            pool=self.pool,
            caller=writer(records),
            token=self.token,
        )
        # Upserts are idempotent by document id: a retry after a lost reply rewrites the
        # same documents.
        await retrieval.unary("Upsert", request, retry=PATIENT_POLICY)


class RerankPreparer:
    """Sends acknowledged documents to rerank's `Prepare`; gives up for the rest of the run
    at the first failure (rerank absent or overloaded must not slow ingest down)."""

    TIMEOUT_S = 60.0

    def __init__(self, address: str, pool: ChannelPool, notice=None, token=None) -> None:
        from ragline.v1 import rerank_pb2_grpc

        self.token = token
        self.address = address
        self.pool = pool
        self.stub_class = rerank_pb2_grpc.RerankServiceStub
        self.notice = notice or (lambda text: None)
        self.prepared = 0
        self.given_up: str | None = None
        self.model_version = ""  # the embedding model rerank's token vectors come from
        self.offers_embeddings = True

    async def prepare(self, records: list[Record], *, embeddings: bool = False):
        """`records`: one tenant's, sent as EMBED_CHUNK-document calls at once (short model
        runs, on every runner). With `embeddings`: (vector, model version) per record from
        the same runs, or None: rerank failed (given up for the run) or gave no embeddings
        (asked again without them from then on)."""
        import grpc

        from ragline.v1 import rerank_pb2
        from ragline_services.retrieval.documents import passage_text

        if self.given_up:
            return None
        client = ServiceClient(
            self.stub_class,
            self.address,
            pool=self.pool,
            caller=identity.Caller(records[0].tenant),
            token=self.token,
        )
        documents = [
            rerank_pb2.PrepareDocument(id=r.id, text=passage_text(r.title, r.text)) for r in records
        ]
        try:
            with deadlines.deadline_scope(self.TIMEOUT_S):
                replies = await asyncio.gather(
                    *(
                        client.unary(
                            "Prepare",
                            rerank_pb2.PrepareRequest(
                                documents=documents[start : start + EMBED_CHUNK],
                                return_embeddings=embeddings,
                            ),
                        )
                        for start in range(0, len(documents), EMBED_CHUNK)
                    )
                )
        except grpc.aio.AioRpcError as error:
            if embeddings and error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.offers_embeddings = False  # its model embeds passages otherwise
                return None
            if not self.given_up:  # said once, though batches in flight fail together
                self.given_up = f"{error.code().name}: {error.details()}"
                self.notice(
                    f"rerank at {self.address} did not prepare token vectors ({self.given_up}); "
                    "they will be computed on the first question about each document"
                )
            return None
        self.prepared += sum(r.prepared + r.already_prepared for r in replies)
        self.model_version = replies[-1].embedding_model_version
        if not embeddings:
            return None
        vectors = [(e.values, r.embedding_model_version) for r in replies for e in r.embeddings]
        if len(vectors) != len(records):  # a rerank older than return_embeddings
            self.offers_embeddings = False
            return None
        return vectors


async def prepare_rerank(
    path: Path,
    *,
    rerank_addr: str,
    default_tenant: str,
    batch_size: int = 64,
    notice=None,
    token: str | None = None,
) -> int:
    """Sends the good records of `path` to rerank's `Prepare` only (the index has them
    already, the rerank process was restarted). Returns the documents it holds vectors of."""
    pool = ChannelPool()
    preparer = RerankPreparer(rerank_addr, pool, notice, token)
    good = (r for r in read_records(path, default_tenant) if isinstance(r, Record))
    try:
        for records, _ in tenant_batches(good, batch_size):
            if preparer.given_up:
                break
            await preparer.prepare(records)
    finally:
        await pool.close()
    return preparer.prepared


DEMO_CORPUS = Path(__file__).with_name("data") / "squad_dev_sample.json"
DEMO_TENANT = "default"


async def load_demo(
    *,
    retrieval_addr: str,
    embedding_addr: str,
    data_dir: Path,
    rerank_addr: str | None = None,
    notice=None,
    token: str | None = None,
) -> int:
    """Ingests the demo corpus into tenant `default` unless that tenant has documents
    already (a restarted stack keeps its index). Returns the documents written."""
    from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc

    status_client = ServiceClient(
        retrieval_pb2_grpc.RetrievalServiceStub,
        retrieval_addr,
        caller=identity.Caller(DEMO_TENANT),
        token=token,
    )
    with deadlines.deadline_scope(30.0):
        status = await status_client.unary(
            "IndexStatus", retrieval_pb2.IndexStatusRequest(), retry=PATIENT_POLICY
        )
    if status.tenant_documents:
        if rerank_addr:  # rerank keeps token vectors in memory: a restarted stack has none
            await prepare_rerank(
                DEMO_CORPUS,
                rerank_addr=rerank_addr,
                default_tenant=DEMO_TENANT,
                notice=notice,
                token=token,
            )
        return 0
    checkpoint = Checkpoint(data_dir / "ingest" / "demo-corpus.json")
    checkpoint.path.unlink(missing_ok=True)
    checkpoint.done = 0
    written, _ = await ingest(
        DEMO_CORPUS,
        retrieval_addr=retrieval_addr,
        embedding_addr=embedding_addr,
        default_tenant=DEMO_TENANT,
        checkpoint=checkpoint,
        rerank_addr=rerank_addr,
        notice=notice,
        token=token,
    )
    return written
