"""The GGUF reader; its home is `engine.model_files.gguf` (torch-free)."""

from engine.model_files.gguf import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFFile, GGUFTensorInfo

__all__ = ["DEFAULT_ALIGNMENT", "GGUF_MAGIC", "GGUFFile", "GGUFTensorInfo"]
