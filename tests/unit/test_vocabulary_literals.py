"""A vocabulary is spelled in its enum only: no model tier, search mode, fusion method, node
state, answer state, cache policy or language is written as a bare string where the code
decides with it.

Where the code decides: a comparison (`mode == "hybrid"`, `tier in ("small", ...)`), a
set or list of a vocabulary's words, a mapping with two or more of them as keys or as values
(a conversion table), constants assigned two or more of them at once, a default
(`tier: str = "small"`, `def f(mode="bm25")`), a keyword argument or an assignment named
after the vocabulary (`fusion="rrf"`, `state = "failed"`). Words that
mean something else in other places (a record's "vector" field, a node id "bm25") are
not decisions about the vocabulary and are left alone.
"""

from __future__ import annotations

import ast
import enum
from pathlib import Path

import pytest

from ragline.vocabulary import (
    CachePolicy,
    Fusion,
    Language,
    ModelTier,
    SearchMode,
)
from ragline_services.orchestrator.runner import NodeState
from ragline_services.orchestrator.verdict import AnswerState
from support import REPO_ROOT

VOCABULARIES: dict[type[enum.StrEnum], tuple[str, ...]] = {
    # The enum, and the words a name that holds one of its values contains.
    ModelTier: ("tier",),
    SearchMode: ("mode",),
    Fusion: ("fusion",),
    NodeState: ("state",),
    AnswerState: ("state",),
    CachePolicy: ("policy", "cache"),
    Language: ("language",),
    # FinishReason and SkipCause are left out: their words ("deadline", "length", "stop")
    # are also answer reasons and verbs, so the checker cannot tell a decision about them.
}
CHECKED = [
    REPO_ROOT / "libs" / "ragline",
    REPO_ROOT / "services",
    REPO_ROOT / "app",
    REPO_ROOT / "tools",
]


def _words(vocabulary: type[enum.StrEnum]) -> set[str]:
    return {member.value for member in vocabulary}


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _enum_bodies(tree: ast.AST) -> set[int]:
    """Line numbers inside the class bodies of the checked enums (where the words live)."""
    names = {vocabulary.__name__ for vocabulary in VOCABULARIES}
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in names:
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _named_for(name: str, vocabulary: type[enum.StrEnum]) -> bool:
    return any(word in name.lower() for word in VOCABULARIES[vocabulary])


def _target_name(target: ast.AST) -> str:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return ""


def literal_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, word, vocabulary) for each place `source` decides with a bare word."""
    tree = ast.parse(source)
    skip = _enum_bodies(tree)
    found: list[tuple[int, str, str]] = []

    def report(node: ast.AST, text: str, vocabulary: type[enum.StrEnum]) -> None:
        if node.lineno not in skip:
            found.append((node.lineno, text, vocabulary.__name__))

    def any_vocabulary(node: ast.AST) -> None:
        text = _text(node)
        for vocabulary in VOCABULARIES:
            if text is not None and text in _words(vocabulary):
                report(node, text, vocabulary)

    def named(node: ast.AST, name: str) -> None:
        text = _text(node)
        for vocabulary in VOCABULARIES:
            if text is not None and text in _words(vocabulary) and _named_for(name, vocabulary):
                report(node, text, vocabulary)

    def collection(elements: list[ast.AST | None], least: int) -> None:
        texts = [(e, _text(e)) for e in elements if e is not None]
        for vocabulary in VOCABULARIES:
            hits = [(e, t) for e, t in texts if t is not None and t in _words(vocabulary)]
            if len(hits) >= least:
                for element, text in hits:
                    report(element, text, vocabulary)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                any_vocabulary(operand)
                if isinstance(operand, ast.Tuple | ast.List | ast.Set):
                    collection(operand.elts, 1)
        elif isinstance(node, ast.Set):
            collection(node.elts, 1)
        elif isinstance(node, ast.List):
            collection(node.elts, 2)
        elif isinstance(node, ast.Dict):
            collection(node.keys, 2)
            collection(node.values, 2)
        elif isinstance(node, ast.keyword) and node.arg:
            named(node.value, node.arg)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            named(node.value, _target_name(node.target))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                named(node.value, _target_name(target))
            if isinstance(node.value, ast.Tuple):  # A, B = "a", "b": constants by hand
                collection(node.value.elts, 2)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            positional = [*arguments.posonlyargs, *arguments.args]
            for argument, default in zip(
                positional[len(positional) - len(arguments.defaults) :],
                arguments.defaults,
                strict=True,
            ):
                named(default, argument.arg)
            for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
                if default is not None:
                    named(default, argument.arg)
    return found


def _sources() -> list[Path]:
    return sorted(p for root in CHECKED for p in root.rglob("*.py") if "/v1/" not in str(p))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_vocabulary_word_outside_its_enum(path: Path) -> None:
    uses = literal_uses(path.read_text(encoding="utf-8"))
    assert not uses, "\n".join(
        f"{path.relative_to(REPO_ROOT)}:{line}: {word!r} is {vocabulary}.{word.upper()}"
        for line, word, vocabulary in uses
    )


@pytest.mark.parametrize(
    "source",
    [
        'if mode == "hybrid": pass',
        'ok = tier in ("small", "large")',
        '_TIERS = {"small": 1, "large": 2}',
        'CHOICES = {"rrf", "score"}',
        'def f(fusion="rrf"): pass',
        "class S:\n    state: str = 'pending'",
        'request(cache_policy="bypass")',
        'outcome.state = "partial"',
        '_MODES = {1: "hybrid", 2: "bm25"}',
        'SMALL, LARGE = "small", "large"',
    ],
)
def test_each_kind_of_use_is_found(source: str) -> None:
    assert literal_uses(source), source


@pytest.mark.parametrize(
    "source",
    [
        'record = {"vector": encoded, "model": name}',  # a field name, one word of a vocabulary
        'Node("fuse", Kind.FUSE, ("bm25", "vector"))',  # node ids
        "class SearchMode(enum.StrEnum):\n    HYBRID = 'hybrid'",
        'stage = "score"',
    ],
)
def test_other_meanings_of_the_words_are_left_alone(source: str) -> None:
    assert not literal_uses(source), source
