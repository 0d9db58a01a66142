"""The model manifest and the local model store (`ragline models ...`)."""

from ragline.models.store import ModelError, ModelSpec, ModelStore, default_model_dir

__all__ = ["ModelError", "ModelSpec", "ModelStore", "default_model_dir"]
