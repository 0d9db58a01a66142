"""Dependencies point one way: application -> services -> kit -> stubs.

The kit (`ragline`, libs/ragline) imports no service and not the application; a service
(`ragline_services.<name>`) imports no other service and not the application.
"""

from __future__ import annotations

import pytest

from support import load_tool

KIT, SERVICES, APP = "ragline", "ragline_services", "ragline_app"


structure = load_tool("draw_structure")
imported_modules = structure.imported_modules
all_modules = structure.all_modules


def violations(module: str, imports: set[str]) -> list[str]:
    """Imports of `module` that point the wrong way."""
    top = module.split(".")[0]
    bad = []
    for name in sorted(imports):
        parts = name.split(".")
        if top == KIT and parts[0] in (SERVICES, APP):
            bad.append(f"{module} (kit) imports {name}")
        elif top == SERVICES:
            own = module.split(".")[1] if module.count(".") else ""
            if parts[0] == APP:
                bad.append(f"{module} (service) imports the application: {name}")
            elif (
                parts[0] == SERVICES
                and len(parts) > 1
                and parts[1] not in (own, "registry")
                and own != "registry"
            ):
                bad.append(f"{module} (service {own}) imports another service: {name}")
    return bad


def test_every_import_points_one_way():
    problems = []
    for module, path in sorted(all_modules().items()):
        problems += violations(module, imported_modules(path.read_text()))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("ragline.clients", "from ragline_services.embedding import service"),
        ("ragline.config", "def f():\n    import ragline_app.stack"),
        (
            "ragline_services.generation.service",
            "from ragline_services.embedding.backends import x",
        ),
        ("ragline_services.retrieval.index", "from ragline_app.stack import free_ports"),
    ],
)
def test_the_check_catches_an_import_the_wrong_way(module, source):
    assert violations(module, imported_modules(source))


def test_allowed_imports_pass():
    assert not violations("ragline_app.cli", imported_modules("import ragline_services.registry"))
    assert not violations(
        "ragline_services.retrieval.index",
        imported_modules("from ragline_services.retrieval import bm25"),
    )
    assert not violations("ragline.clients", imported_modules("from ragline.v1 import common_pb2"))
