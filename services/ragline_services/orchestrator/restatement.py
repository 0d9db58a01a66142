"""An answer without the question it restates: "Stiff means poor seismic performance." to
"What does it mean for a structure if it is stiff?" answers "poor seismic performance".

The prompt asks for a few words copied from the evidence, and the small model still writes
a sentence now and then, opening with the question's own words and a linking verb ("The
result of this ruling would be the elimination of ...", "William Berry's name after he was
ennobled was Lord Camrose", "You could vote."). Such a sentence is a right answer in a
form an agent cannot use, and the checks read it as a wrong one: its opening words stand
nowhere near each other in the passage, so the verifier finds the question's words far
from "the answer" and refuses it (on new_wiki 8 of 150 drafts opened so, 7 of them right
once cut; docs/answer-states.md, "Answers that restate the question").

`core` cuts the opening run of such a sentence: words that are the question's (stemmed,
or sharing their first five letters: "defined" / "definition"), function words and
pronouns, up to its last linking verb ("is", "means", "would be", "was", "could", "known
as"), when what follows adds a word of its own. It cuts nothing from an answer that:
- has no linking verb in its opening run ("Foreign Reporter of the Year": the question's
  words there are the answer's own head),
- answers a question that offers choices ("..., the female or the male?": the options are
  the question's words, and one of them is the answer),
- says yes, no or not before the verb (the cut would drop the answer's polarity),
- is Chinese (segmentation and copulas differ; left to the checks), or holds a citation
  marker in the part it would cut.
Pure; the answer step applies it to every draft, of either tier, before its checks.
"""

from __future__ import annotations

import re

from ragline.words import FUNCTION_WORDS, has_han, stem
from ragline_services.orchestrator import evidence as ev

# Verbs that link a restated subject to what is said of it ("X is Y", "X means Y", "X
# would be Y", "X is known as Y"): the cut ends after the last of them.
_LINKS = frozenset(
    """is are was were be been being means mean meant refers refer called known named defined
    described considered would could can will may might should must has have had include
    includes included consists consist contains contain as""".split()
)
_PRONOUNS = frozenset("it they he she this these those there you we i its their".split())
# Words that carry the answer's polarity: an opening run holding one is never cut.
_POLARITY = frozenset("yes no not never".split())
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\u2019\-]*")
_SHARED_PREFIX = 5  # letters two words share to count as one ("defined", "definition")
_CHOICE = re.compile(r"\bor\b", re.IGNORECASE)


def _question_word(word: str, asked: frozenset[str]) -> bool:
    """`asked`: the question's stems and the first _SHARED_PREFIX letters of its long ones."""
    term = stem(word)
    return term in asked or (len(term) >= _SHARED_PREFIX and term[:_SHARED_PREFIX] in asked)


def core(question: str, answer: str) -> str:
    """`answer` without an opening restatement of `question` (see the module's docstring),
    or `answer` unchanged."""
    if has_han(answer) or has_han(question) or _CHOICE.search(question):
        return answer
    stems = {stem(w) for w in _WORD.findall(question)}
    asked = frozenset(stems | {s[:_SHARED_PREFIX] for s in stems if len(s) >= _SHARED_PREFIX})
    markers = [m.span() for m in ev.MARKER.finditer(answer)]
    words = [w for w in _WORD.finditer(answer) if not any(a <= w.start() < b for a, b in markers)]
    cut = None
    for index, found in enumerate(words):
        word = found.group().lower()
        if word in _POLARITY:
            return answer
        if word in _LINKS:
            cut = index
        elif not (word in FUNCTION_WORDS or word in _PRONOUNS or _question_word(word, asked)):
            break
    else:
        return answer  # nothing but the question's words: nothing left to keep
    if cut is None:
        return answer
    end = words[cut].end()
    if ev.MARKER.search(answer[:end]):
        return answer
    rest = answer[end:].lstrip(" ,:;-\u2013\u2014")
    adds = any(
        w.lower() not in FUNCTION_WORDS and not _question_word(w, asked)
        for w in _WORD.findall(ev.strip_markers(rest))
    )
    return rest if adds else answer
