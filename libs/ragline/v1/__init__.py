"""Generated protobuf / gRPC stubs of the ragline.v1 contracts (built from proto/ by setup.py)."""

from pathlib import Path


def __getattr__(name: str):
    # Reached before a submodule is imported; only explain when the stub file is missing.
    if name.endswith(("_pb2", "_pb2_grpc")) and not (Path(__file__).parent / f"{name}.py").exists():
        raise ImportError(
            f"ragline.v1.{name} is not generated yet: stubs are built at install time; "
            "run `make install` (or `pip install -e .`) from the repository root"
        )
    raise AttributeError(f"module 'ragline.v1' has no attribute {name!r}")
