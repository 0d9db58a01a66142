"""Tokenization for the embedding models (HF `tokenizers`, from the model's tokenizer.json)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ragline.errors import InvalidArgument

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer


@dataclass(frozen=True)
class TokenizedText:
    ids: np.ndarray  # int64, [tokens]
    truncated: bool
    # Segment of each token (0: first text, 1: second) for encoded pairs.
    type_ids: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


class Tokenizer:
    def __init__(self, tokenizer_json: Path, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._json = tokenizer_json
        self._tokenizer = self._load(truncation="longest_first")

    def _load(self, truncation: str) -> HfTokenizer:
        """A tokenizer of the file cutting as `truncation` says. Parsing holds the GIL (0.65 s
        for multilingual-e5's 250k-piece vocabulary, seconds on a busy machine): each one
        is made only when used."""
        from tokenizers import Tokenizer as HfTokenizer

        tokenizer = HfTokenizer.from_file(str(self._json))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_tokens, strategy=truncation)
        return tokenizer

    # Only the cross-encoder encodes pairs: a pair keeps its first text (the query) whole
    # and cuts the second (a passage), unless the query alone is too long: then both are cut,
    # as the texts' own tokenizer cuts (`longest_first`).
    @functools.cached_property
    def _pairs(self) -> HfTokenizer:
        return self._load(truncation="only_second")

    def vocabulary(self) -> dict[str, int]:
        """Token string -> id (special tokens included)."""
        vocabulary: dict[str, int] = self._tokenizer.get_vocab(with_added_tokens=True)
        return vocabulary

    def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[TokenizedText]:
        """[CLS] first [SEP] second [SEP], with segment ids, cut to max_tokens."""
        try:
            encodings = self._pairs.encode_batch(pairs)
        except Exception:  # a query longer than the window: cut per pair, both sides
            encodings = []
            for pair in pairs:
                try:
                    encodings.append(self._pairs.encode(*pair))
                except Exception:
                    encodings.append(self._tokenizer.encode(*pair))
        out = []
        for encoding in encodings:
            out.append(
                TokenizedText(
                    np.asarray(encoding.ids, dtype=np.int64),
                    bool(encoding.overflowing),
                    np.asarray(encoding.type_ids, dtype=np.int64),
                )
            )
        return out

    def encode(self, texts: list[str], *, refuse_over_limit: bool) -> list[TokenizedText]:
        """Tokenizes `texts`; over-long ones are cut to max_tokens or refused (INVALID_ARGUMENT)."""
        encodings = self._tokenizer.encode_batch(texts)
        out = []
        for index, encoding in enumerate(encodings):
            truncated = bool(encoding.overflowing)
            if truncated and refuse_over_limit:
                raise InvalidArgument(
                    f"texts[{index}]",
                    f"is longer than the model's {self.max_tokens}-token window; shorten it or "
                    "use truncation TRUNCATION_END",
                )
            out.append(TokenizedText(np.asarray(encoding.ids, dtype=np.int64), truncated))
        return out
