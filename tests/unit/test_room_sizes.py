"""Rooms a newcomer reads (issue 58): no function of the packages over 80 lines, and a file
over 500 lines says at its top why it is one file."""

from __future__ import annotations

import ast

from support import load_tool

MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500
REASON = "Why one file of this length"

structure = load_tool("draw_structure")


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method longer than `limit` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def unexplained_length(source: str, limit: int = MAX_FILE_LINES) -> bool:
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return len(source.splitlines()) > limit and REASON not in docstring


def test_no_function_is_longer_than_80_lines():
    found = [
        f"{module}.{name}: {lines} lines"
        for module, path in sorted(structure.all_modules().items())
        for name, lines in long_functions(path.read_text())
    ]
    assert not found, "split these (issue 58):\n" + "\n".join(found)


def test_a_file_over_500_lines_says_why_at_its_top():
    found = [
        module
        for module, path in sorted(structure.all_modules().items())
        if unexplained_length(path.read_text())
    ]
    assert not found, f"over {MAX_FILE_LINES} lines with no '{REASON}' in the docstring: {found}"


def test_the_checks_find_what_they_name():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def f():\n{body[: -len('    x79 = 79') - 1]}") == []
    filler = "x = 1\n" * MAX_FILE_LINES
    assert unexplained_length(f'"""A module."""\n{filler}')
    assert not unexplained_length(f'"""A module.\n\n{REASON}: it is one idea."""\n{filler}')
