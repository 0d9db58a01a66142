"""The structure of the code, drawn from its own imports: docs/structure.md.

    .venv/bin/python tools/draw_structure.py           # writes docs/structure.md
    .venv/bin/python tools/draw_structure.py --check   # fails where it is out of date

Each folder is named as it is imported (`services/ragline_services/orchestrator` is
`ragline_services.orchestrator`), so the drawing names folders by their import names and
nothing maps one to the other. A package whose folder is named otherwise stops the drawing.
tests/unit/test_import_direction.py reads the same imports to hold the direction rules.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Import name -> its folder, in the order dependencies point (the application first).
PACKAGES = {
    "ragline_app": REPO / "app" / "ragline_app",
    "ragline_services": REPO / "services" / "ragline_services",
    "ragline": REPO / "libs" / "ragline",
}
GENERATED = REPO / "libs" / "ragline" / "v1"  # the protobuf stubs: drawn as one box
OUT = REPO / "docs" / "structure.md"


def check_folders_named_as_imported(packages: dict[str, Path] = PACKAGES) -> None:
    for name, folder in packages.items():
        if folder.name != name or not (folder / "__init__.py").is_file():
            raise SystemExit(f"package {name} is not the folder {folder} named as it is imported")


def module_name(path: Path, packages: dict[str, Path] = PACKAGES) -> str:
    """`services/ragline_services/orchestrator/core.py` -> `ragline_services.orchestrator.core`:
    the folders below the package's parent, as they are named."""
    for folder in packages.values():
        if path.is_relative_to(folder):
            parts = path.relative_to(folder.parent).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(f"{path} is in no package")


def all_modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Every module of the three packages (the generated stubs left out)."""
    modules = {}
    for folder in packages.values():
        for path in sorted(folder.rglob("*.py")):
            if not path.is_relative_to(GENERATED):
                modules[module_name(path, packages)] = path
    return modules


def imported_modules(source: str) -> set[str]:
    """Every module an `import` or `from ... import` names, wherever it stands (lazy
    imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def folder_of(module: str, modules: dict[str, Path]) -> str | None:
    """The folder (as imported) holding `module`, or None when it is not ours."""
    if module.split(".")[0] not in PACKAGES:
        return None
    if module == "ragline.v1" or module.startswith("ragline.v1."):
        return "ragline.v1"
    while module and module not in modules:
        module = module.rpartition(".")[0]  # `from pkg.mod import name`: the module
    if not module:
        return None
    path = modules[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def folder_edges(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """folder -> {folder it imports: how many of its modules import it}."""
    edges: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for module, path in modules.items():
        source = folder_of(module, modules)
        assert source is not None
        edges[source]  # a folder that imports nothing of ours is drawn too
        targets = {folder_of(name, modules) for name in imported_modules(path.read_text())}
        for target in sorted(t for t in targets if t and t != source):
            edges[source][target] += 1
    return edges


def _folder_path(folder: str) -> str:
    top = PACKAGES[folder.split(".")[0]]
    return str((top.parent / folder.replace(".", "/")).relative_to(REPO)) + "/"


def _node_id(folder: str) -> str:
    return folder.replace(".", "_")


def render(modules: dict[str, Path]) -> str:
    edges = folder_edges(modules)
    folders = sorted(set(edges) | {t for targets in edges.values() for t in targets})
    counts: dict[str, int] = defaultdict(int)
    for module in modules:
        counts[folder_of(module, modules) or ""] += 1
    lines = [
        "# The structure, from the code's imports",
        "",
        "Drawn by `tools/draw_structure.py` from every `import` in the three packages",
        "(`tests/unit/test_structure_drawing.py` fails when this file is out of date). A box",
        "is a folder, named as it is imported; its folder in the repository is the import name",
        "with dots as slashes under `libs/`, `services/` or `app/`. An arrow is an import:",
        "its number is how many modules of the folder import the other. Dependencies point one",
        "way, application -> services -> kit -> stubs (`tests/unit/test_import_direction.py`).",
        "",
        "```mermaid",
        "flowchart LR",
    ]
    for package in PACKAGES:
        lines.append(f"  subgraph {package}")
        for folder in folders:
            if folder.split(".")[0] == package:
                size = "stubs" if folder == "ragline.v1" else f"{counts[folder]} modules"
                lines.append(f'    {_node_id(folder)}["{folder}<br/>{size}"]')
        lines.append("  end")
    for source in folders:
        for target, count in sorted(edges.get(source, {}).items()):
            lines.append(f"  {_node_id(source)} -->|{count}| {_node_id(target)}")
    lines += [
        "```",
        "",
        "| folder (as imported) | in the repository | modules | imports | imported by |",
        "|---|---|---|---|---|",
    ]
    for folder in folders:
        imports = ", ".join(f"`{t}`" for t in sorted(edges.get(folder, {}))) or "-"
        users = ", ".join(f"`{s}`" for s in folders if folder in edges.get(s, {})) or "-"
        size = "stubs" if folder == "ragline.v1" else str(counts[folder])
        lines.append(f"| `{folder}` | `{_folder_path(folder)}` | {size} | {imports} | {users} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/structure.md is stale")
    args = parser.parse_args(argv)
    check_folders_named_as_imported()
    drawn = render(all_modules())
    if args.check:
        if not OUT.is_file() or OUT.read_text() != drawn:
            print(f"{OUT.relative_to(REPO)} is out of date: run tools/draw_structure.py")
            return 1
        return 0
    OUT.write_text(drawn)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
