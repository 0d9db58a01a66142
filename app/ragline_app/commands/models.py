"""`ragline models`: list, fetch and verify the models the manifest names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="list, fetch and verify models (see the manifest)")
    models.add_argument("action", choices=["list", "prepare", "verify"])
    models.add_argument(
        "names", nargs="*", help="models (default: those the services' settings name)"
    )
    models.add_argument(
        "--model-dir", help="model store (default RAGLINE_MODEL_DIR or ~/.cache/ragline/models)"
    )
    models.set_defaults(func=cmd_models)


def cmd_models(args: argparse.Namespace) -> int:
    from ragline.models import ModelError, ModelStore
    from ragline.models.prepare_all import prepare_all

    store = ModelStore(Path(args.model_dir) if args.model_dir else None)
    if args.action == "list":
        for name, spec in sorted(store.specs.items()):
            if spec.parts:
                source = f"{len(spec.parts)} parts from {spec.parts[0].package}..."
            elif spec.downloadable:
                source = f"{spec.package}=={spec.version}"
            elif spec.derive:
                source = f"derived from {spec.derived_from} ({spec.derive})"
            else:
                source = f"export of {spec.derived_from} ({spec.export})"
            state = "ready" if store.is_ready(name) else "-"
            print(f"{name:<24} {spec.kind:<15} {state:<6} {source:<40} {spec.licence}")
        print(f"(store: {store.root})")
        return 0
    names = args.names or default_models()
    if args.action == "prepare":
        failures = prepare_all(store, names)
    else:
        failures = {}
        for name in names:
            try:
                store.verify(name)
                print(f"{name}: verified")
            except ModelError as error:
                failures[name] = error
    for failure in failures.values():
        print(f"ragline models {args.action}: {failure}", file=sys.stderr)
    return 1 if failures else 0


def default_models() -> list[str]:
    """The models the services run with their settings as configured now (defaults and
    RAGLINE_* variables): what `ragline up` needs ready."""
    from ragline_services.embedding.service import EmbeddingConfig
    from ragline_services.generation.service import GenerationConfig
    from ragline_services.rerank.service import RerankConfig

    rerank = RerankConfig()
    generation = GenerationConfig()
    names = [
        EmbeddingConfig().model,
        rerank.token_model,
        rerank.cross_encoder_model,
        generation.small_model,
        generation.large_model,
    ]
    return list(dict.fromkeys(n for n in names if n))
