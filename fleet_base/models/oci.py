"""`oci://registry/repository:tag` (or `@sha256:<digest>`): a model packed as an OCI
artifact, ORAS style (each file a layer titled `org.opencontainers.image.title`) or CNCF
ModelPack (`org.cncf.model.filepath`). oras-py reads the manifest and its auth (docker
config); every layer is checked against its digest and resumes with `Range`.

Registries on a loopback address, or listed in `FLEET_OCI_INSECURE_REGISTRIES`
(comma-separated host:port), are spoken to over plain HTTP.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fleet_base.models.errors import (
    MissingObject,
    ModelStoreError,
    NoCredentials,
    StoreUnreachable,
)
from fleet_base.models.source import Listing, Progress, RemoteFile, Source, match_uri, safe_name
from fleet_base.models.transfer import resume_offset, store_errors, write_chunks

_URI = re.compile(
    r"^oci://(?P<registry>[A-Za-z0-9.-]+(?::\d{1,5})?)/(?P<repo>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
TITLE_KEYS = ("org.cncf.model.filepath", "org.opencontainers.image.title")
MANIFEST_TYPES = ["application/vnd.oci.image.manifest.v1+json"]
CHUNK = 256 << 10


def insecure(registry: str) -> bool:
    listed = {h.strip() for h in os.environ.get("FLEET_OCI_INSECURE_REGISTRIES", "").split(",") if h.strip()}
    host = registry.rsplit(":", 1)[0]
    return registry in listed or host in ("localhost", "127.0.0.1", "::1")


def _error(err: Exception, what: str) -> ModelStoreError:
    import requests

    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    if status in (401, 403):
        return NoCredentials(f"{what}: HTTP {status}; log in to the registry (docker config)")
    if status == 404:
        return MissingObject(f"{what}: HTTP 404")
    if isinstance(err, requests.ConnectionError | requests.Timeout):
        return StoreUnreachable(f"{what}: {err}")
    text = str(err)
    if "404" in text or "Not Found" in text or "UNKNOWN" in text:
        return MissingObject(f"{what}: {text[:300]}")
    if "401" in text or "403" in text or "Unauthorized" in text or "Forbidden" in text:
        return NoCredentials(f"{what}: {text[:300]}")
    return ModelStoreError(f"{what}: {text[:300]}")


class OciSource(Source):
    """An ORAS / ModelPack artifact: each titled layer of the manifest is one model file."""

    scheme = "oci"

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        m = match_uri(_URI, uri, "oci://registry/repository:tag or @sha256:<digest>")
        self.registry, self.repo = m["registry"], m["repo"]
        self.tag, self.digest = m["tag"], m["digest"]
        if not self.tag and not self.digest:
            self.tag = "latest"
        self._client: Any = None

    @property
    def canonical(self) -> str:
        ref = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"oci://{self.registry}/{self.repo}{ref}"

    @property
    def target(self) -> str:
        return f"{self.registry}/{self.repo}" + (f"@{self.digest}" if self.digest else f":{self.tag}")

    @property
    def client(self) -> Any:
        if self._client is None:
            import oras.provider

            self._client = oras.provider.Registry(hostname=self.registry, insecure=insecure(self.registry))
        return self._client

    def listing(self) -> Listing:
        try:
            manifest = self.client.get_manifest(self.target, allowed_media_type=MANIFEST_TYPES)
        except Exception as err:
            raise _error(err, self.canonical) from err
        files = []
        for layer in manifest.get("layers", []):
            notes = layer.get("annotations") or {}
            title = next((notes[k] for k in TITLE_KEYS if notes.get(k)), None)
            if title is None:
                continue  # an untitled layer is no file of the model
            digest = str(layer.get("digest", ""))
            files.append(
                RemoteFile(
                    name=safe_name(title, self.uri), size=int(layer["size"]), digest=digest, ref=digest
                )
            )
        if not files:
            raise MissingObject(
                f"{self.canonical}: the artifact has no titled layers (not an ORAS/ModelPack model)"
            )
        config = manifest.get("config", {}).get("digest", "")
        return Listing(files=sorted(files, key=lambda f: f.name), pinned=str(config))

    def fetch(self, file: RemoteFile, part: Path, progress: Progress) -> None:
        offset = resume_offset(part, file)
        if offset == file.size:
            return
        client = self.client
        with store_errors(_error, f"{self.canonical} {file.ref}"):
            container = client.get_container(self.target)
            url = f"{client.prefix}://{container.get_blob_url(file.ref)}"
            headers = {**client.headers, **({"Range": f"bytes={offset}-"} if offset else {})}
            with client.do_request(url, "GET", headers=headers, stream=True) as r:
                r.raise_for_status()
                mode = "ab" if offset and r.status_code == 206 else "wb"
                write_chunks(part, mode, r.iter_content(chunk_size=CHUNK), progress)
