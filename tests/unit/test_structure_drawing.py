"""docs/structure.md is drawn from the code's imports, and every folder is named as it is
imported (tools/draw_structure.py)."""

from __future__ import annotations

import pytest

from support import REPO_ROOT, load_tool

draw = load_tool("draw_structure")


def test_the_drawing_is_the_code_as_it_is():
    drawn = draw.render(draw.all_modules())
    assert (REPO_ROOT / "docs" / "structure.md").read_text() == drawn, (
        "docs/structure.md is out of date: run tools/draw_structure.py"
    )


def test_every_package_folder_is_named_as_it_is_imported():
    draw.check_folders_named_as_imported()
    for module, path in draw.all_modules().items():
        # The import name is the path below libs/, services/ or app/, dots for slashes.
        top = path.relative_to(REPO_ROOT).parts[0]
        assert top in ("libs", "services", "app"), path
        below = path.relative_to(REPO_ROOT / top).with_suffix("")
        parts = below.parts[:-1] if below.name == "__init__" else below.parts
        assert ".".join(parts) == module


def test_a_package_in_a_folder_named_otherwise_stops_the_drawing(tmp_path):
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "__init__.py").write_text("")
    with pytest.raises(SystemExit, match="ragline_services"):
        draw.check_folders_named_as_imported({"ragline_services": tmp_path / "services"})


def test_an_import_is_drawn_between_folders_once_per_module():
    modules = draw.all_modules()
    edges = draw.folder_edges(modules)
    importers = {
        m
        for m, p in modules.items()
        if m.startswith("ragline_services.orchestrator.")
        and any(
            n == "ragline.deadlines" or n.startswith("ragline.deadlines.")
            for n in draw.imported_modules(p.read_text())
        )
    }
    assert importers, "the orchestrator uses the kit's deadlines"
    assert edges["ragline_services.orchestrator"]["ragline"] >= len(importers)
    assert "ragline_app" not in edges["ragline_services.orchestrator"]
