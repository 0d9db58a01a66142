"""Build hook: generate the protobuf / gRPC stubs from proto/ before packaging.

Stubs are never committed. `pip install .` and `pip install -e .` both run build_py,
which writes them next to the shared library (libs/ragline/v1/*_pb2*.py).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
STUB_ROOT = ROOT / "libs"  # proto/ragline/v1/x.proto -> libs/ragline/v1/x_pb2.py
PACKAGE_ROOTS = {
    "ragline": ROOT / "libs" / "ragline",
    "ragline_services": ROOT / "services" / "ragline_services",
    "ragline_app": ROOT / "app" / "ragline_app",
}


def generate_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={STUB_ROOT}",
        f"--pyi_out={STUB_ROOT}",
        f"--grpc_python_out={STUB_ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")


# Folders of data inside the packages (no __init__.py): listed as packages too, or
# setuptools warns on every install that it may stop shipping them.
DATA_PACKAGES = [
    "ragline.models.bundled",
    "ragline.models.calibration",
    "ragline_app.data",
    "ragline_app.data.zh_eval",
]


def find_packages() -> list[str]:
    packages = []
    for top, path in PACKAGE_ROOTS.items():
        for init in sorted(path.rglob("__init__.py")):
            rel = init.parent.relative_to(path).parts
            packages.append(".".join((top, *rel)))
    return packages + DATA_PACKAGES


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(
    packages=find_packages(),
    package_data={
        "ragline": [
            "py.typed",
            "v1/*.pyi",
            "models/manifest.toml",
            "models/bundled/*/*",
            "models/calibration/*",
        ],
        "ragline_app": ["data/*.json", "data/*.md", "data/zh_eval/*.txt", "data/zh_eval/*.md"],
    },
    cmdclass={"build_py": BuildPyWithStubs},
)
