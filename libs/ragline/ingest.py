"""`ragline ingest PATH`: load documents into the retrieval service.

Reads SQuAD JSON (every paragraph becomes a document) or JSONL (`{id, title, text, tenant,
acl, attributes}` per line), checks every record, embeds the good ones through the embedding
service in batches and upserts them with their vectors. Bad records are reported (line and
reason) and skipped; the good ones still go in. Progress is checkpointed after every
acknowledged batch, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ragline.clients import ChannelPool, EmbeddingClient, RetrievalClient
from ragline.identity import Caller

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SCOPE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


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
        data = json.loads(path.read_text())
        number = 0
        for a_idx, article in enumerate(data["data"]):
            for p_idx, paragraph in enumerate(article["paragraphs"]):
                number += 1
                yield Record(
                    number,
                    default_tenant,
                    f"{path.stem}:{a_idx}:{p_idx}",
                    article["title"].replace("_", " "),
                    paragraph["context"],
                )
        return
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                if not isinstance(raw, dict):
                    raise ValueError("not a JSON object")
            except ValueError as error:
                yield BadRecord(number, f"invalid JSON: {error}")
                continue
            yield check(number, raw, default_tenant)


def check(number: int, raw: dict, default_tenant: str) -> Record | BadRecord:
    tenant = str(raw.get("tenant") or default_tenant)
    doc_id, text = raw.get("id"), raw.get("text")
    title = raw.get("title") or ""
    acl = raw.get("acl") or []
    attributes = raw.get("attributes") or {}
    problems = []
    if not _TENANT.match(tenant):
        problems.append(f"tenant {tenant!r} must be 1-64 of letters, digits, '_.-'")
    if not isinstance(doc_id, str | int) or not str(doc_id) or len(str(doc_id).encode()) > 256:
        problems.append("id must be a non-empty string of at most 256 bytes")
    if not isinstance(text, str) or not text.strip():
        problems.append("text is missing or empty")
    elif len(text.encode()) > 65536:
        problems.append(f"text is {len(text.encode())} bytes; the limit is 65536")
    if not isinstance(title, str) or len(title.encode()) > 1024:
        problems.append("title must be a string of at most 1024 bytes")
    if not isinstance(acl, list) or not all(isinstance(s, str) and _SCOPE.match(s) for s in acl):
        problems.append("acl must be a list of scopes (letters, digits, '_.:@-')")
    if not isinstance(attributes, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in attributes.items()
    ):
        problems.append("attributes must map strings to strings")
    if problems:
        return BadRecord(number, "; ".join(problems))
    return Record(number, tenant, str(doc_id), title, text, list(acl), dict(attributes))


class Checkpoint:
    """The highest record number acknowledged, per input file (resume point)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = json.loads(path.read_text())["done"] if path.exists() else 0

    def save(self, done: int) -> None:
        self.done = max(self.done, done)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"done": self.done}))
        tmp.replace(self.path)


async def _call_with_retries(fn, request, attempts: int = 5):
    for attempt in range(1, attempts + 1):
        try:
            return await fn(request)
        except grpc.aio.AioRpcError as error:
            if error.code() not in _RETRYABLE or attempt == attempts:
                raise
            await asyncio.sleep(min(0.5 * 2**attempt, 10))
    raise AssertionError("unreachable")


async def ingest(
    path: Path,
    *,
    retrieval_addr: str,
    embedding_addr: str,
    default_tenant: str,
    batch_size: int = 64,
    checkpoint: Checkpoint,
    progress=None,
) -> tuple[int, list[BadRecord]]:
    """Returns (documents written, bad records)."""
    from ragline.v1 import embedding_pb2, retrieval_pb2
    from ragline_services.retrieval.documents import passage_text

    pool = ChannelPool()
    embedder = EmbeddingClient(embedding_addr, pool=pool)
    bad: list[BadRecord] = []
    written = 0
    pending: dict[str, list[Record]] = {}

    async def flush(records: list[Record]) -> None:
        nonlocal written
        texts = [passage_text(r.title, r.text) for r in records]
        vectors = await _call_with_retries(
            embedder.embed,
            embedding_pb2.EmbedRequest(texts=texts, input_type=embedding_pb2.INPUT_TYPE_PASSAGE),
        )
        request = retrieval_pb2.UpsertRequest()
        for record, embedding in zip(records, vectors.embeddings, strict=True):
            request.documents.add(
                id=record.id,
                title=record.title,
                text=record.text,
                acl=record.acl,
                attributes=record.attributes,
                vector=embedding.values,
            )
        retrieval = RetrievalClient(retrieval_addr, pool=pool, caller=Caller(records[0].tenant))
        await _call_with_retries(retrieval.upsert, request)
        written += len(records)

    last_number = checkpoint.done
    try:
        for item in read_records(path, default_tenant):
            last_number = item.number
            if progress is not None:
                progress(item.number)
            if item.number <= checkpoint.done:
                continue
            if isinstance(item, BadRecord):
                bad.append(item)
                continue
            batch = pending.setdefault(item.tenant, [])
            batch.append(item)
            if len(batch) >= batch_size:
                await flush(pending.pop(item.tenant))
                if not pending:  # everything before this record is acknowledged
                    checkpoint.save(item.number)
        for tenant in list(pending):
            await flush(pending.pop(tenant))
        checkpoint.save(last_number)
    finally:
        await pool.close()
    return written, bad
