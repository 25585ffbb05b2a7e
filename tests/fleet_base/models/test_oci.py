"""oci:// against a real OCI registry (docker-distribution on a free port), with the
artifact pushed by oras-py the way `oras push` lays a model out (one titled layer per
file). Checks the layer digests and a missing tag."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleet_base.models import ChecksumMismatch, MissingObject, ModelCache
from fleet_base.models.source import RemoteFile
from fleet_base.models.verify import check_file


def _push(
    registry: str, tmp_path: Path, files: dict[str, bytes], ref: str, annotations: dict | None = None
) -> None:
    import oras.client

    src = tmp_path / "push"
    src.mkdir()
    paths = []
    for name, data in files.items():
        (src / name).write_bytes(data)
        paths.append(str(src / name))
    client = oras.client.OrasClient(hostname=registry, insecure=True)
    cwd = os.getcwd()
    os.chdir(src)  # oras titles each layer with the path as given
    try:
        notes = None
        if annotations:
            notes = src / "annotations.json"
            notes.write_text(json.dumps(annotations))
        client.push(
            target=f"{registry}/{ref}",
            files=[Path(p).name for p in paths],
            disable_path_validation=True,
            annotation_file=str(notes) if notes else None,
        )
    finally:
        os.chdir(cwd)


def test_pull_an_oras_artifact(oci_registry: str, cache: ModelCache, tmp_path: Path) -> None:
    files = {"model.gguf": os.urandom(700_000), "README.txt": b"weights"}
    _push(oci_registry, tmp_path, files, "models/smol:v1")
    result = cache.pull(f"oci://{oci_registry}/models/smol:v1")
    assert result.downloaded
    folder = cache.model_dir(result.entry)
    for name, data in files.items():
        assert (folder / name).read_bytes() == data
    with pytest.raises(MissingObject):
        cache.pull(f"oci://{oci_registry}/models/smol:v2")


def test_modelpack_file_paths_are_honoured(oci_registry: str, cache: ModelCache, tmp_path: Path) -> None:
    """CNCF ModelPack names each layer's place in the model with `org.cncf.model.filepath`."""
    files = {"model.safetensors": os.urandom(200_000), "config.json": b"{}"}
    paths = {"model.safetensors": "weights/model.safetensors", "config.json": "config.json"}
    annotations = {name: {"org.cncf.model.filepath": path} for name, path in paths.items()}
    _push(oci_registry, tmp_path, files, "models/pack:v1", annotations)
    entry = cache.pull(f"oci://{oci_registry}/models/pack:v1").entry
    assert sorted(f.name for f in entry.files) == ["config.json", "weights/model.safetensors"]
    assert (cache.model_dir(entry) / "weights/model.safetensors").read_bytes() == files["model.safetensors"]


def test_layer_digest_is_enforced(tmp_path: Path) -> None:
    path = tmp_path / "layer"
    path.write_bytes(b"not what the manifest says")
    file = RemoteFile(name="layer", size=path.stat().st_size, digest="sha256:" + "1" * 64)
    with pytest.raises(ChecksumMismatch):
        check_file(path, file)
