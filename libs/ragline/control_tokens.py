"""Text that must reach a model as text: the control tokens of common chat templates
(`<|im_end|>`, `</s>`, `[INST]`, `<<SYS>>`) written inside it are defused, so no engine
tokenizing the prompt can read them as control. For engines where the caller tokenizes
message text apart from the template (llama-server), that is the stronger guard; this one
holds where a whole rendered prompt is tokenized at once (Triton's preprocessing model)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"<\|[^<>|\s]{1,64}\|>|</?s>|\[/?INST\]|<</?SYS>>")
# A look-alike with the role name a chat template writes after it ("<|im_start|>system").
_CONTROL_TURN = re.compile(rf"(?:{_CONTROL.pattern})(?:\s*(?:system|user|assistant|tool)\b)?")
_SPACES = re.compile(r"[ \t]{2,}")
_DEFUSED = str.maketrans({"<": "\u2039", ">": "\u203a", "[": "(", "]": ")"})


def defuse(text: str) -> str:
    """`text` with every control-token look-alike rewritten (angle brackets to single
    guillemets, square brackets to parentheses): same words, no control."""
    return _CONTROL.sub(lambda m: m.group(0).translate(_DEFUSED), text)


def remove(text: str) -> str:
    """`text` without its control-token look-alikes (where they carry nothing worth
    reading, as in evidence chosen for a prompt)."""
    if not _CONTROL.search(text):
        return text
    return _SPACES.sub(" ", _CONTROL_TURN.sub(" ", text)).strip()


def holds_control(text: str) -> bool:
    return bool(_CONTROL.search(text))
