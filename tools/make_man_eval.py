"""Builds the man-page QA set (`app/ragline_app/data/man_eval/`): a technical-documentation
collection the product was never tuned on, in SQuAD format so every tool reads it with
`--data`.

    .venv/bin/python tools/make_man_eval.py            # writes man_eval_v1.json
    .venv/bin/python tools/make_man_eval.py --dump DIR # the paragraphs, to write questions

The paragraphs are the manual pages that Debian's packages ship (rendered with `man`, one
paragraph per option or prose block); the questions are written by hand in
`app/ragline_app/data/man_eval/questions.txt` (its header says how), each naming its page, a
phrase of its paragraph and its answer, which must be a span of that paragraph. Questions no
paragraph answers are SQuAD 2.0's `is_impossible` entries; two-part questions carry their
parts (each with its own paragraph and answer) under `parts`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "app" / "ragline_app" / "data" / "man_eval"
# The pages, in article order: the first half (fit) then the second half (report).
PAGES = ("ssh_config.5", "zstd.1", "gzip.1", "tar.1", "xz.1", "less.1")
_MIN_WORDS = 12
_MAX_WORDS = 160
_BULLET = re.compile(r"^[\u25cb\u25cf\u2022·]\s+")


def render(page: str) -> str:
    name, section = page.rsplit(".", 1)
    env = {**os.environ, "MANWIDTH": "2000", "LANG": "C.UTF-8", "MAN_KEEP_FORMATTING": ""}
    out = subprocess.run(
        ["man", "-P", "cat", section, name], capture_output=True, text=True, env=env, check=True
    ).stdout
    out = re.sub(".\b", "", out)  # overstrike (bold, underline)
    return out.replace("\u2019", "'").replace("\u00b4", "'").replace("\u2010", "-")


def package_of(page: str) -> tuple[str, str]:
    name, section = page.rsplit(".", 1)
    path = subprocess.run(
        ["man", "-w", section, name], capture_output=True, text=True, check=True
    ).stdout.strip()
    package = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, check=True)
    package_name = package.stdout.split(":")[0]
    version = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package_name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return package_name, version


def paragraphs(text: str) -> list[tuple[str, str]]:
    """(section, paragraph) pairs: an option's tag joined to its description, short blocks
    joined to the next of their section."""
    blocks: list[tuple[str, list[str]]] = []
    section, current = "", []
    for line in text.splitlines()[1:]:
        if not line.strip():
            if current:
                blocks.append((section, current))
                current = []
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            if current:
                blocks.append((section, current))
                current = []
            if line.strip().isupper() or len(line.split()) <= 4:
                section = line.strip().title()
            continue
        if indent == 3 and len(line.split()) <= 8 and not current:
            section = line.strip()
            continue
        current.append(line.strip())
    if current:
        blocks.append((section, current))
    out: list[tuple[str, str]] = []
    pending, pending_section = "", ""
    for section, lines in blocks:
        bullet = bool(_BULLET.match(lines[0]))
        lines = [_BULLET.sub("", line) for line in lines]
        if len(lines) > 1 and len(lines[0].split()) <= 6 and lines[0].startswith("-"):
            lines = [f"{lines[0]}:", *lines[1:]]
        text = re.sub(r"\s+", " ", " ".join(lines)).strip()
        if pending and pending_section != section:
            out.append((pending_section, pending))
            pending = ""
        if bullet and out and out[-1][0] == section and not pending:
            # A list item belongs with its list (and the sentence that opens it).
            if len(out[-1][1].split()) + len(text.split()) <= _MAX_WORDS:
                out[-1] = (section, f"{out[-1][1]} {text}")
                continue
        text = f"{pending} {text}".strip() if pending else text
        if len(text.split()) < _MIN_WORDS:
            pending, pending_section = text, section
            continue
        pending = ""
        out.append((section, text))
    if pending:
        out.append((pending_section, pending))
    return out


def read_questions(path: Path) -> list[dict]:
    """The hand-written questions: `Q: page | phrase of its paragraph | question || answer`,
    `U: question` (no paragraph answers it), and `M: question` followed by its parts as
    `  part: page | phrase | question || answer` lines."""
    entries: list[dict] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.rstrip()
        if not line.strip() or line.startswith("#"):
            continue
        kind, _, body = line.strip().partition(" ")

        def answered(body: str) -> dict:
            page, phrase, rest = (x.strip() for x in body.split("|", 2))
            question, *answers = (x.strip() for x in rest.split("||"))
            return {"page": page, "phrase": phrase, "question": question, "answers": answers}

        if kind == "Q:":
            entries.append({"kind": "answerable", **answered(body), "line": number})
        elif kind == "U:":
            entries.append({"kind": "impossible", "question": body.strip(), "line": number})
        elif kind == "M:":
            entries.append({"kind": "multi", "question": body.strip(), "parts": [], "line": number})
        elif kind == "part:":
            entries[-1]["parts"].append(answered(body))
        else:
            raise SystemExit(f"{path}:{number}: not a line of this format: {raw[:50]!r}")
    return entries


def build(pages: dict[str, list[tuple[str, str]]], entries: list[dict]) -> dict:
    """The SQuAD 2.0 document: one article per page; each question under its paragraph."""
    articles = []
    index: dict[str, list[dict]] = {}
    for page, found in pages.items():
        name, section = page.rsplit(".", 1)
        paras = [{"context": text, "qas": [], "section": sec} for sec, text in found]
        index[page] = paras
        articles.append({"title": f"{name}({section})", "paragraphs": paras})

    def place(item: dict, line: int) -> tuple[dict, list[dict]]:
        page = item["page"]
        for paragraph in index[page]:
            context = paragraph["context"]
            if item["phrase"] in context and all(a in context for a in item["answers"]):
                return paragraph, [
                    {"text": a, "answer_start": context.index(a)} for a in item["answers"]
                ]
        raise SystemExit(f"line {line}: no paragraph of {page} holds {item['phrase']!r} and "
                         f"{item['answers']!r}")  # fmt: skip

    counter = 0
    for entry in entries:
        counter += 1
        qid = f"man-{counter:03d}"
        if entry["kind"] == "answerable":
            paragraph, answers = place(entry, entry["line"])
            paragraph["qas"].append({"id": qid, "question": entry["question"], "answers": answers})
        elif entry["kind"] == "impossible":
            # Filed under the first paragraph of the first page (SQuAD 2.0 keeps every
            # question under a paragraph); no paragraph answers it.
            articles[0]["paragraphs"][0]["qas"].append(
                {"id": qid, "question": entry["question"], "answers": [], "is_impossible": True}
            )
        else:
            parts = []
            for part in entry["parts"]:
                paragraph, answers = place(part, entry["line"])
                article = next(i for i, p in enumerate(pages) if p == part["page"])
                parts.append(
                    {
                        "question": part["question"],
                        "answers": answers,
                        "article": article,
                        "paragraph": index[part["page"]].index(paragraph),
                    }
                )
            first = entry["parts"][0]
            home, _ = place(first, entry["line"])
            home["qas"].append(
                {"id": qid, "question": entry["question"], "answers": [], "parts": parts}
            )
    return {"version": "man_eval_v1", "data": articles}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dump", type=Path, help="write each page's paragraphs here, numbered")
    parser.add_argument("--out", type=Path, default=HERE / "man_eval_v1.json")
    args = parser.parse_args()
    pages = {page: paragraphs(render(page)) for page in PAGES}
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        for page, found in pages.items():
            lines = [f"[{i}] ({sec}) {text}" for i, (sec, text) in enumerate(found)]
            (args.dump / f"{page}.txt").write_text("\n\n".join(lines) + "\n")
        print({page: len(found) for page, found in pages.items()})
        return 0
    document = build(pages, read_questions(HERE / "questions.txt"))
    text = json.dumps(document, ensure_ascii=False, indent=1) + "\n"
    args.out.write_text(text)
    sources = {page: package_of(page) for page in PAGES}
    counts = {"paragraphs": sum(len(a["paragraphs"]) for a in document["data"])}
    qas = [q for a in document["data"] for p in a["paragraphs"] for q in p["qas"]]
    counts["answerable"] = sum(bool(q["answers"]) for q in qas)
    counts["impossible"] = sum(bool(q.get("is_impossible")) for q in qas)
    counts["two-part"] = sum(bool(q.get("parts")) for q in qas)
    print(json.dumps({"sources": sources, **counts}, indent=1))
    print("sha256", hashlib.sha256(text.encode()).hexdigest(), args.out.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
