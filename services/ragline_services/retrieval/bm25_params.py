"""BM25 with parameters Tantivy does not take: its candidates scored again from its own
term statistics.

Tantivy fixes k1 = 1.2 and b = 0.75. Where the settings name others, the search asks Tantivy
for a deeper pool of candidates, reads each one's explanation (per matched term: idf, the
term's frequency in the field, the field's length and the average length) and computes
each term's BM25 contribution again with the chosen k1 and b; sums, boosts (a translated
word weighs less) and constant-score filters combine as Tantivy combined them. The pool is
deeper than the k asked because another k1 reorders documents near the cut.

What it costs is measured by tools/eval_bm25_params.py (the explanation of one candidate
is a few tens of microseconds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Tantivy's own, fixed (tantivy::query::bm25).
TANTIVY_K1 = 1.2
TANTIVY_B = 0.75
# Candidates scored again per result asked, and at most.
POOL_FACTOR = 4
MAX_POOL = 400


@dataclass(frozen=True)
class Bm25Params:
    k1: float = TANTIVY_K1
    b: float = TANTIVY_B

    @property
    def native(self) -> bool:
        """Whether Tantivy's scores are already these parameters' scores."""
        return abs(self.k1 - TANTIVY_K1) < 1e-9 and abs(self.b - TANTIVY_B) < 1e-9

    def pool(self, k: int) -> int:
        """Candidates to score again for the best `k`."""
        return k if self.native else max(k, min(k * POOL_FACTOR, MAX_POOL))

    def term_score(self, idf: float, freq: float, dl: float, avgdl: float) -> float:
        """One term's contribution, as Tantivy writes it: (k1+1) idf tf / (tf + k1 norm)."""
        norm = 1.0 - self.b + self.b * (dl / avgdl if avgdl > 0 else 1.0)
        return (self.k1 + 1.0) * idf * freq / (freq + self.k1 * norm)

    def rescore(self, explanation: str) -> float:
        """A document's score under these parameters, from Tantivy's explanation (JSON)."""
        return self._node(json.loads(explanation))[1]

    def _node(self, node: dict[str, Any]) -> tuple[float, float]:
        """(the node's value as Tantivy computed it, its value under these parameters)."""
        value = float(node.get("value", 0.0))
        description = str(node.get("description", ""))
        children = node.get("details") or []
        if description.startswith("TermQuery"):
            return value, self._term(node, value)
        if not children:
            return value, value
        scored = [self._node(child) for child in children]
        if "sum of" in description:
            return value, sum(new for _, new in scored)
        if description.startswith("Boost") and len(scored) == 1:
            old_child, new_child = scored[0]
            return value, new_child * (value / old_child) if old_child else value
        # Anything else (a phrase scorer, a product Tantivy may add): moved by what its
        # term queries moved.
        return value, value + sum(new - old for old, new in scored)

    def _term(self, node: dict[str, Any], value: float) -> float:
        idf = stats = None
        for child in node.get("details") or []:
            description = str(child.get("description", ""))
            if description.startswith("idf"):
                idf = float(child["value"])
            elif description.startswith("freq /"):
                stats = {
                    str(d.get("description", "")).split(",")[0]: float(d["value"])
                    for d in child.get("details") or []
                }
        if idf is None or stats is None or not {"freq", "dl", "avgdl"} <= set(stats):
            return value  # an explanation without the statistics: Tantivy's own score
        return self.term_score(idf, stats["freq"], stats["dl"], stats["avgdl"])


# Tantivy's own parameters (its scores as they are).
TANTIVY = Bm25Params()
