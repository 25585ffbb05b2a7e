"""Model names -> local files; the home is `engine.model_files.aliases` (torch-free)."""

from engine.model_files.aliases import ALIASES, ModelAlias, ModelNotFoundError, resolve_model_path

__all__ = ["ALIASES", "ModelAlias", "ModelNotFoundError", "resolve_model_path"]
