"""Materialise models from the registry packages that carry them, and verify them.

Layout of the store (RAGLINE_MODEL_DIR, default <RAGLINE_CACHE_DIR>/models):
    <name>/<file>            the model's files
    <name>/.verified.json    sha256, size and mtime of each file when it was last verified
A file is re-hashed only when its size or mtime changed since it was verified.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).with_name("manifest.toml")
STAMP = ".verified.json"

# Where a preparation says what it does (print, or a structlog line).
Log = Callable[[str], None]


class ModelError(RuntimeError):
    """A model is unknown, missing or fails verification; the message says what to run."""


def default_model_dir() -> Path:
    from ragline.config import CommonConfig

    model_dir = CommonConfig().model_dir
    assert model_dir is not None  # the config fills it in (cache_dir/models)
    return model_dir


@dataclass(frozen=True)
class ModelFile:
    name: str
    path_in_wheel: str
    sha256: str


@dataclass(frozen=True)
class ModelPart:
    """One piece of a model split over several packages (concatenated in order)."""

    package: str
    version: str
    wheel_sha256: str
    path_in_wheel: str
    sha256: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str
    description: str
    licence: str
    package: str = ""
    version: str = ""
    wheel_sha256: str = ""
    files: tuple[ModelFile, ...] = ()
    # Split models: `parts` are concatenated into `assembled` (sha256 `assembled_sha256`).
    parts: tuple[ModelPart, ...] = ()
    assembled: str = ""
    assembled_sha256: str = ""
    # Bundled models: files committed in this package (a folder beside the manifest), made
    # here (a reranker ragline trains) and pinned by sha256 like the rest.
    bundled: str = ""
    derived_from: str = ""
    export: str = ""
    # Derived at prepare time from `derived_from` by a recipe of ragline.models.derive
    # (ONNX Runtime only), with `calibration` (a file beside the manifest) where it needs text.
    derive: str = ""
    calibration: str = ""
    output: str = ""
    tokenizer: str = ""
    dim: int = 0
    max_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def downloadable(self) -> bool:
        return bool(self.package or self.parts or self.bundled)

    @property
    def preparable(self) -> bool:
        """`ragline models prepare` can make it (download, copy or derive)."""
        return self.downloadable or bool(self.derive)


def load_manifest(path: Path = MANIFEST) -> dict[str, ModelSpec]:
    data = tomllib.loads(path.read_text())
    specs = {}
    for name, entry in data["models"].items():
        entry = dict(entry)
        files = tuple(
            ModelFile(file_name, info["path"], info["sha256"])
            for file_name, info in entry.pop("files", {}).items()
        )
        parts = tuple(
            ModelPart(p["package"], p["version"], p["wheel_sha256"], p["path"], p["sha256"])
            for p in entry.pop("parts", ())
        )
        known = {
            f
            for f in ModelSpec.__dataclass_fields__
            if f not in ("name", "files", "parts", "extra")
        }
        specs[name] = ModelSpec(
            name=name,
            files=files,
            parts=parts,
            **{k: v for k, v in entry.items() if k in known},
            extra={k: v for k, v in entry.items() if k not in known},
        )
    return specs


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, pinned: str, what: str) -> None:
    """Raises ModelError naming `what` unless `path` has the sha256 the manifest pins."""
    actual = sha256_of(path)
    if actual != pinned:
        raise ModelError(f"{what} has sha256 {actual}, the manifest pins {pinned}")


def hashes_of(directory: Path) -> dict[str, str]:
    """The sha256 of each file directly in `directory`, by name."""
    return {p.name: sha256_of(p) for p in sorted(directory.iterdir()) if p.is_file()}


class ModelStore:
    def __init__(self, root: Path | None = None, manifest: Path = MANIFEST) -> None:
        self.root = root or default_model_dir()
        self.manifest = manifest
        self.specs = load_manifest(manifest)

    def spec(self, name: str) -> ModelSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise ModelError(
                f"unknown model {name!r}; the manifest lists {', '.join(sorted(self.specs))}"
            ) from None

    def directory(self, name: str) -> Path:
        return self.root / self.spec(name).name

    # -- verification ---------------------------------------------------------------------

    def expected_hashes(self, name: str) -> dict[str, str]:
        spec = self.spec(name)
        if spec.parts:
            return {spec.assembled: spec.assembled_sha256}
        if spec.downloadable:
            return {f.name: f.sha256 for f in spec.files}
        sidecar = self.directory(name) / "export.json"
        if not sidecar.exists():
            return {}
        hashes: dict[str, str] = json.loads(sidecar.read_text())["sha256"]
        return hashes

    def verify(self, name: str) -> None:
        """Raises ModelError unless every file of `name` is present with its sha256."""
        directory = self.directory(name)
        expected = self.expected_hashes(name)
        if not expected:
            raise ModelError(self._missing_message(name))
        self._check_recipe_revision(name)
        stamp_path = directory / STAMP
        stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else {}
        changed = False
        for file_name, sha in expected.items():
            path = directory / file_name
            if not path.exists():
                raise ModelError(self._missing_message(name))
            stat = path.stat()
            seen = stamp.get(file_name)
            if seen == {"sha256": sha, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
                continue
            actual = sha256_of(path)
            if actual != sha:
                raise ModelError(
                    f"model {name}: {path} has sha256 {actual}, the manifest pins {sha}; "
                    f"delete {directory} and run `ragline models prepare {name}`"
                )
            stamp[file_name] = {"sha256": sha, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
            changed = True
        if changed:
            try:
                stamp_path.write_text(json.dumps(stamp, indent=1))
            except OSError:
                # A read-only store (the image's models): verified all the same; the stamp
                # only saves the next start from hashing again.
                pass

    def _check_recipe_revision(self, name: str) -> None:
        """A derived model's files must come from the recipe revision this ragline derives
        (files derived before a recipe changed are derived again by `prepare`)."""
        spec = self.spec(name)
        if not spec.derive:
            return
        from ragline.models.derive import RECIPES

        recipe = RECIPES.get(spec.derive)
        if recipe is None:
            return  # prepare names an unknown recipe
        sidecar = json.loads((self.directory(name) / "export.json").read_text())
        # Files derived before revisions were recorded are revision 1.
        made_by = sidecar.get("made_by", {"recipe": spec.derive, "revision": 1})
        if (made_by["recipe"], made_by["revision"]) != (spec.derive, recipe.revision):
            raise ModelError(
                f"model {name} in {self.directory(name)} was derived by recipe "
                f"{made_by['recipe']} revision {made_by['revision']}; this ragline derives it "
                f"by {spec.derive} revision {recipe.revision}: run `ragline models prepare "
                f"{name}` (a new model version: an index embedded with the old one re-embeds, "
                "answering from BM25 alone until it has)"
            )

    def _missing_message(self, name: str) -> str:
        spec = self.spec(name)
        if spec.preparable:
            return (
                f"model {name} is not prepared in {self.root}; run `ragline models prepare {name}`"
            )
        return (
            f"model {name} is made by `python tools/export_onnx.py` (from {spec.derived_from}) "
            f"and is not in {self.root} yet"
        )

    def file(self, name: str, file_name: str) -> Path:
        """Path of a verified model file."""
        self.verify(name)
        return self.directory(name) / file_name

    def gguf_file(self, name: str) -> Path:
        """Path of a verified gguf model's weights: the assembled file of a split model,
        else its model.gguf."""
        return self.file(name, self.spec(name).assembled or "model.gguf")

    def version(self, name: str) -> str:
        """The version caches and indexes key on: the pinned sha256 of the model's main file
        (the assembled file, the one model file, or `main`), never a re-hash at start."""
        spec = self.spec(name)
        hashes = self.expected_hashes(name)
        if not hashes:
            raise ModelError(self._missing_message(name))
        main = spec.assembled or next((f for f in hashes if f.endswith((".onnx", ".gguf"))), None)
        return f"{name}@{hashes[main or sorted(hashes)[0]][:16]}"

    def is_ready(self, name: str) -> bool:
        try:
            self.verify(name)
        except ModelError:
            return False
        return True

    # -- materialisation ------------------------------------------------------------------

    def dependencies(self, name: str) -> list[str]:
        """What `prepare(name)` prepares first: the tokenizer the model reads beside it at run
        time, and the model it derives from while it is not ready (a derived model's source
        is needed only to derive it: an image that bakes the derived files alone serves them
        offline)."""
        spec = self.spec(name)
        dependencies = []
        if spec.tokenizer and spec.tokenizer != name:
            dependencies.append(spec.tokenizer)
        if spec.derived_from and spec.derived_from != name and not self.is_ready(name):
            dependencies.append(spec.derived_from)
        return dependencies

    def prepare(self, name: str, log: Log = print) -> Path:
        """Makes `name` (and the models it needs) ready; idempotent and verified."""
        spec = self.spec(name)
        for dependency in self.dependencies(name):
            self.prepare(dependency, log=log)
        if self.is_ready(name):
            return self.directory(name)
        if not spec.preparable:
            raise ModelError(self._missing_message(name))
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=f".{name}-") as tmp:
            tmp_path = Path(tmp)
            staging = tmp_path / "files"
            staging.mkdir()
            if spec.derive:
                self._derive(spec, staging, log)
            elif spec.parts:
                self._assemble(spec, tmp_path, staging / spec.assembled, log)
            elif spec.bundled:
                source = self.manifest.parent / spec.bundled
                for model_file in spec.files:
                    target = staging / model_file.name
                    shutil.copyfile(source / model_file.path_in_wheel, target)
                    check_sha256(
                        target, model_file.sha256, f"bundled {source / model_file.path_in_wheel}"
                    )
            else:
                from ragline.models import fetch

                log(f"fetching {spec.package}=={spec.version} for model {name}")
                fetch.package_files(spec, tmp_path, staging, log)
            directory = self.directory(name)
            if directory.exists():
                shutil.rmtree(directory)
            staging.rename(directory)
        self.verify(name)
        log(f"model {name} ready in {self.directory(name)}")
        return self.directory(name)

    def _derive(self, spec: ModelSpec, staging: Path, log: Log) -> None:
        from ragline.models.derive import RECIPES

        recipe = RECIPES.get(spec.derive)
        if recipe is None:
            raise ModelError(
                f"model {spec.name}: unknown recipe {spec.derive!r} (known: {', '.join(RECIPES)})"
            )
        log(
            f"deriving model {spec.name} from {spec.derived_from} "
            f"({spec.derive}, revision {recipe.revision})"
        )
        report = recipe.make(self, spec, staging, log)
        hashes = hashes_of(staging)
        made_by = {"recipe": spec.derive, "revision": recipe.revision}
        (staging / "export.json").write_text(
            json.dumps({"sha256": hashes, "made_by": made_by, "report": report}, indent=1)
        )

    def _assemble(self, spec: ModelSpec, tmp: Path, target: Path, log: Log) -> None:
        """Fetches the parts (fetch.py), concatenates them in order, checks the whole."""
        from ragline.models import fetch

        with target.open("wb") as whole:
            for piece in fetch.pieces(spec, tmp, log):
                with piece.open("rb") as src:
                    shutil.copyfileobj(src, whole, 1 << 20)
                piece.unlink()
        check_sha256(
            target, spec.assembled_sha256, f"model {spec.name}: the assembled {spec.assembled}"
        )

    def record_export(self, name: str, hashes: dict[str, str], report: dict[str, Any]) -> None:
        """Written by tools/export_onnx.py next to the files it made."""
        directory = self.directory(name)
        (directory / "export.json").write_text(
            json.dumps({"sha256": hashes, "report": report}, indent=1)
        )
