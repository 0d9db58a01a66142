"""`ragline ingest FILE`: documents (SQuAD JSON or JSONL) into retrieval, resumable."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from ragline.config import CommonConfig

if TYPE_CHECKING:
    from ragline_app.ingest import Checkpoint


def register(sub: argparse._SubParsersAction) -> None:
    ingest = sub.add_parser("ingest", help="load documents (SQuAD JSON or JSONL) into retrieval")
    ingest.add_argument("path")
    ingest.add_argument(
        "--tenant",
        default=None,
        help="tenant of records that name none (default: the token's, else 'default')",
    )
    ingest.add_argument(
        "--token",
        default=os.environ.get("RAGLINE_TOKEN", ""),
        help="client token (JWT) when authentication is on (default: $RAGLINE_TOKEN)",
    )
    ingest.add_argument("--batch", type=int, default=64)
    ingest.add_argument("--checkpoint", help="resume file (default .ragline/ingest/...)")
    ingest.add_argument("--restart", action="store_true", help="ignore an earlier checkpoint")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.add_argument(
        "--no-rerank-prepare",
        action="store_true",
        help="do not send documents to rerank's Prepare (token vectors then come on first use)",
    )
    ingest.add_argument(
        "--separate-passes",
        action="store_true",
        help="embed every passage through the embedding service even when rerank's token "
        "pass runs the same model (two model runs per passage instead of one)",
    )
    ingest.set_defaults(func=cmd_ingest)


def cmd_ingest(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from ragline_app.ingest import IngestStats, ingest
    from ragline_app.stack import service_address

    common = CommonConfig()
    path = Path(args.path)
    if not path.exists():
        print(f"ragline ingest: {path} does not exist", file=sys.stderr)
        return 2
    args.tenant = args.tenant or _token_tenant(args.token) or "default"
    checkpoint = _checkpoint(args, common.data_dir, path)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=not sys.stdout.isatty(),
        disable=args.quiet,
    ) as bar:
        task = bar.add_task(f"ingest {path.name}", total=None)
        stats = IngestStats()
        try:
            written, bad = asyncio.run(
                ingest(
                    path,
                    retrieval_addr=service_address("retrieval", common.data_dir),
                    embedding_addr=service_address("embedding", common.data_dir),
                    default_tenant=args.tenant,
                    batch_size=args.batch,
                    checkpoint=checkpoint,
                    progress=lambda n: bar.update(task, completed=n),
                    rerank_addr=(
                        None
                        if args.no_rerank_prepare
                        else service_address("rerank", common.data_dir)
                    ),
                    token=args.token or None,
                    notice=lambda text: bar.console.print(f"ragline ingest: {text}"),
                    one_pass=not args.separate_passes,
                    stats=stats,
                )
            )
        except grpc.aio.AioRpcError as error:
            print(
                f"ragline ingest: {error.code().name}: {error.details()} (progress is "
                f"saved; run again to resume)",
                file=sys.stderr,
            )
            return 1
    print(f"ingested {written} documents from {path}")
    if stats.embedded_by_rerank:
        print(
            f"{stats.embedded_by_rerank} of {stats.embedded_by_rerank + stats.embedded} passages "
            "embedded in rerank's token pass (one model run each)"
        )
    if bad:
        report = checkpoint.path.with_suffix(".errors.jsonl")
        report.write_text(
            "".join(json.dumps({"record": b.number, "reason": b.reason}) + "\n" for b in bad)
        )
        print(f"{len(bad)} bad records skipped (listed in {report}):", file=sys.stderr)
        for b in bad[:20]:
            print(f"  record {b.number}: {b.reason}", file=sys.stderr)
    return 0


def _checkpoint(args: argparse.Namespace, data_dir: Path, path: Path) -> Checkpoint:
    """Where this input's progress is kept, and what an earlier run of it acknowledged (said:
    those records are skipped, or why the progress kept is not used)."""
    from ragline_app.ingest import Checkpoint  # the command's imports stay lazy

    checkpoint = Checkpoint.for_input(data_dir / "ingest", path, args.tenant, args.token or "")
    if args.checkpoint:
        checkpoint = Checkpoint(Path(args.checkpoint), checkpoint.source)
    if args.restart:
        checkpoint.path.unlink(missing_ok=True)
        checkpoint.done = 0
    if checkpoint.discarded:
        print(
            f"not resuming from {checkpoint.path}: {checkpoint.discarded}; ingesting from the start"
        )
    if checkpoint.done:
        print(
            f"resuming after record {checkpoint.done}: records 1-{checkpoint.done} of {path} "
            f"were acknowledged for tenant {args.tenant!r} by an earlier run and are skipped "
            f"({checkpoint.path}; --restart ingests them again)"
        )
    return checkpoint


def _token_tenant(token: str) -> str | None:
    """The `tenant` claim of a client token, read without verifying it: only to name the
    default tenant of records; every service verifies the token itself."""
    if not token:
        return None
    import jwt

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    tenant = claims.get("tenant")
    return tenant if isinstance(tenant, str) and tenant else None
