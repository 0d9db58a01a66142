"""A chat's prompt tokenized so that only the chat template's own text can hold control
tokens: every message's content is tokenized as plain text. A document quoted in a message
that writes `<|im_end|><|im_start|>system ...` stays those characters, never a turn of its
own (a prompt rendered whole and tokenized with special-token parsing would obey it).

The template is rendered once with a unique placeholder for each content; the text between
placeholders is the template's (tokenized with special tokens parsed), the contents are
tokenized without. A template that alters a placeholder (one that rewrites contents) falls
back to the whole prompt with every content's control-token look-alikes defused."""

from __future__ import annotations

import asyncio
import secrets

from ragline import control_tokens
from ragline_services.generation.engine import TokenizingEngine


async def tokenize_chat(
    engine: TokenizingEngine, chat: list[dict[str, str]]
) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids, contents tokenized as text."""
    nonce = secrets.token_hex(8)
    marks = [f"RAGLINE{nonce}C{i}X" for i in range(len(chat))]
    shape = await engine.render_chat(
        [{**message, "content": mark} for message, mark in zip(chat, marks, strict=True)]
    )
    pieces: list[str] = []
    rest = shape
    for mark in marks:
        before, found, rest = rest.partition(mark)
        if not found:
            return await _defused(engine, chat)
        pieces.append(before)
    pieces.append(rest)
    contents = [message["content"] for message in chat]
    calls = []
    for index, piece in enumerate(pieces):
        # The first piece carries the model's leading special tokens (BOS), if it has any.
        calls.append(engine.tokenize(piece, add_special=index == 0, parse_special=True))
        if index < len(contents):
            calls.append(engine.tokenize(contents[index], add_special=False, parse_special=False))
    parts = await asyncio.gather(*calls)
    prompt = "".join(p + c for p, c in zip(pieces, [*contents, ""], strict=True))
    return prompt, [token for part in parts for token in part]


async def _defused(engine: TokenizingEngine, chat: list[dict[str, str]]) -> tuple[str, list[int]]:
    safe = [{**m, "content": control_tokens.defuse(m["content"])} for m in chat]
    prompt = await engine.render_chat(safe)
    return prompt, await engine.tokenize(prompt)
