"""What one BM25 index per tenant costs, against the shared index it replaced.

    .venv/bin/python tools/bench_tenants.py [--data ../shared/data/squaddev_v1.1.json] \\
        [--tenants 10,1000] [--queries 300] [--baseline-rev 9e56188]

Spreads the collection's paragraphs over N tenants (round robin), writes them in batches
of 64 per tenant the way the service applies writes, then asks each question as the
tenant that owns its paragraph. Reports per layout and tenant count: write time, disk,
search p50/p95 with every tenant index open (warm) and with at most 8 open (cold: most
searches open their tenant's index first), and recall@10 (the paragraph in the top 10).
The baseline is the shared index of `--baseline-rev` (loaded from git), one run, so the
ratios hold on a noisy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragline_app.datasets import load_squad
from ragline_app.eval_data import eval_file
from ragline_services.retrieval.bm25 import Bm25Index
from ragline_services.retrieval.documents import StoredDocument, Visibility, doc_key

REPO = Path(__file__).resolve().parents[1]


def baseline_class(rev: str, workdir: Path):
    source = subprocess.run(
        ["git", "show", f"{rev}:services/ragline_services/retrieval/bm25.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = workdir / "bm25_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("bm25_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Bm25Index


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def run(make, passages, questions, tenants: int, directory: Path) -> dict:
    owner = {p.id: f"tenant{i % tenants}" for i, p in enumerate(passages)}
    index = make(directory)
    started = time.perf_counter()
    batches: dict[str, list[StoredDocument]] = {}
    for p in passages:
        tenant = owner[p.id]
        batch = batches.setdefault(tenant, [])
        batch.append(
            StoredDocument(
                tenant=tenant,
                id=p.id,
                title=p.title,
                text=p.text,
                acl=(),
                attributes={},
                vector=None,
                version=1,
            )
        )
        if len(batch) >= 64:
            index.apply(batches.pop(tenant), [])
    for batch in batches.values():
        index.apply(batch, [])
    write_s = time.perf_counter() - started
    out = {"write_s": write_s, "disk_mb": disk_bytes(directory) / 1e6}
    for label in ("warm", "cold"):
        if label == "cold":
            if not hasattr(index, "max_open"):
                continue  # one shared index: nothing to open per tenant
            index.max_open = 8
            index.close()
        times, found = [], 0
        for q in questions:
            tenant = owner[q.passage_id]
            started = time.perf_counter()
            hits = index.search(q.text, Visibility(tenant), 10)
            times.append(time.perf_counter() - started)
            found += doc_key(tenant, q.passage_id) in {h.key for h in hits}
        out[f"{label}_p50_ms"] = statistics.median(times) * 1000
        out[f"{label}_p95_ms"] = percentile(times, 0.95) * 1000
        out["recall@10"] = found / len(questions)
    index.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=eval_file("squaddev_v1.1.json"))
    parser.add_argument("--tenants", default="10,1000")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--baseline-rev", default="9e56188")
    args = parser.parse_args()
    passages, questions = load_squad(args.data)
    questions = questions[:: max(len(questions) // args.queries, 1)][: args.queries]
    print(f"{len(passages)} passages, {len(questions)} questions", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        work = Path(tmp)
        shared = baseline_class(args.baseline_rev, work)
        for tenants in (int(t) for t in args.tenants.split(",")):
            for name, make in (
                ("shared index", lambda d: shared(d)),
                ("index per tenant", lambda d: Bm25Index(d)),
            ):
                directory = work / f"{name.replace(' ', '-')}-{tenants}"
                result = run(make, passages, questions, tenants, directory)
                rows.append((name, tenants, result))
                print(name, tenants, result, file=sys.stderr)
    print(
        "| layout | tenants | write s | disk MB | search p50 / p95 ms (warm) | "
        "p50 / p95 ms (cold, 8 open) | recall@10 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, tenants, r in rows:
        cold = f"{r['cold_p50_ms']:.2f} / {r['cold_p95_ms']:.2f}" if "cold_p50_ms" in r else "-"
        print(
            f"| {name} | {tenants} | {r['write_s']:.1f} | {r['disk_mb']:.1f} | "
            f"{r['warm_p50_ms']:.2f} / {r['warm_p95_ms']:.2f} | {cold} | {r['recall@10']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
