"""`hf://org/repo[@revision][/file-or-folder]` through huggingface_hub.

`HF_ENDPOINT` picks the hub (a mirror, or a local one in tests), `HF_TOKEN` authenticates.
The listing pins the revision to its commit sha (`pinned_uri`), which the control plane
stores in the deployment record so every node pulls the same bytes. Files are checked by
their LFS sha256, or by their git blob sha1 for small files kept in git. Downloads go
through `hf_hub_download` into a staging folder, which resumes its own partial files.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from pathlib import Path
from typing import Any

from fleet_base.models.errors import (
    MissingObject,
    ModelStoreError,
    NoCredentials,
    StoreUnreachable,
)
from fleet_base.models.source import Listing, Progress, RemoteFile, Source, match_uri, safe_name
from fleet_base.models.transfer import store_errors

_URI = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
    r"(?:@(?P<rev>[\w.-]{1,128}))?(?:/(?P<path>[^\x00-\x1f\x7f]+))?$"
)
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A whole repo: what the engine loads, not every format the repo also ships.
MODEL_FILES = ("*.json", "*.safetensors", "*.gguf", "tokenizer.model", "*.txt", "*.jinja")


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def _error(err: Exception, what: str) -> ModelStoreError:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, GatedRepoError):
        return NoCredentials(f"{what}: gated repository; set HF_TOKEN of an account with access")
    if isinstance(err, RepositoryNotFoundError | RevisionNotFoundError | EntryNotFoundError):
        return MissingObject(f"{what}: {type(err).__name__}")
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            return NoCredentials(f"{what}: HTTP {status}; set HF_TOKEN")
        return ModelStoreError(f"{what}: HTTP {status}")
    if isinstance(err, OSError | ConnectionError) or "connect" in type(err).__name__.lower():
        return StoreUnreachable(f"{what}: {err}")
    return ModelStoreError(f"{what}: {type(err).__name__}: {err}")


class HfSource(Source):
    """A Hugging Face hub repository (or one file of it), pinned to a commit once listed."""

    scheme = "hf"

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        m = match_uri(_URI, uri, "hf://org/repo[@revision][/file]")
        self.repo, self.revision, self.path = m["repo"], m["rev"] or "main", (m["path"] or "").strip("/")
        self.commit = self.revision if COMMIT.match(self.revision) else ""
        if self.path:
            safe_name(self.path, uri)

    @property
    def canonical(self) -> str:
        return f"hf://{self.repo}@{self.revision}" + (f"/{self.path}" if self.path else "")

    def pinned_uri(self, listing: Listing) -> str:
        rev = listing.pinned or self.revision
        return f"hf://{self.repo}@{rev}" + (f"/{self.path}" if self.path else "")

    def pinned(self) -> str:
        """This URI with its revision resolved to a commit (asks the hub unless it is one)."""
        if self.commit:
            return self.canonical
        from huggingface_hub import HfApi

        try:
            info: Any = HfApi(endpoint=endpoint(), token=token()).model_info(
                self.repo, revision=self.revision
            )
        except Exception as err:
            raise _error(err, self.canonical) from err
        if not info.sha:
            raise MissingObject(f"{self.canonical}: the hub did not say which commit it is")
        return f"hf://{self.repo}@{info.sha}" + (f"/{self.path}" if self.path else "")

    def _wanted(self, name: str) -> bool:
        if self.path:
            return name == self.path or name.startswith(self.path + "/")
        return any(fnmatch.fnmatch(name.rsplit("/", 1)[-1], p) for p in MODEL_FILES)

    def listing(self) -> Listing:
        from huggingface_hub import HfApi

        try:
            info: Any = HfApi(endpoint=endpoint(), token=token()).model_info(
                self.repo, revision=self.revision, files_metadata=True
            )
        except Exception as err:
            raise _error(err, self.canonical) from err
        files = []
        for s in info.siblings or []:
            if not self._wanted(s.rfilename):
                continue
            lfs = s.lfs
            if lfs is not None:
                digest, size = f"sha256:{lfs.sha256}", int(lfs.size)
            elif s.blob_id:
                digest, size = f"gitsha1:{s.blob_id}", int(s.size or 0)
            else:
                raise ModelStoreError(f"{self.canonical}: the hub gave no checksum for {s.rfilename}")
            name = (
                s.rfilename[len(self.path) + 1 :] if self.path and s.rfilename != self.path else s.rfilename
            )
            if self.path == s.rfilename:
                name = s.rfilename.rsplit("/", 1)[-1]
            files.append(
                RemoteFile(name=safe_name(name, self.uri), size=size, digest=digest, ref=s.rfilename)
            )
        if not files:
            raise MissingObject(f"{self.canonical}: no model files at this revision")
        self.commit = str(info.sha or self.commit)
        return Listing(files=sorted(files, key=lambda f: f.name), pinned=str(info.sha or ""))

    def fetch(self, file: RemoteFile, part: Path, progress: Progress) -> None:
        from huggingface_hub import hf_hub_download

        staging = part.parent / ".hf"
        revision = self.commit or self.revision  # the files of the listed commit, even if a branch moved
        with store_errors(_error, f"{self.canonical}/{file.ref}"):
            got = hf_hub_download(
                self.repo,
                file.ref,
                revision=revision,
                local_dir=staging,
                endpoint=endpoint(),
                token=token(),
            )
        shutil.move(str(got), part)
        progress(file.size)
