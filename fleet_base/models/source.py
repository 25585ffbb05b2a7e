"""The contract every model store implements, one module per URI scheme.

A `Source` is built from a URI (parsing it, raising `BadModelUri`), lists the files the
model consists of with the store's own checksum of each, and fetches one file into a
partial file, appending from the bytes already there (so an interrupted download
resumes). It never decides where files live or whether they are good: the cache does.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from fleet_base.models.errors import BadModelUri

# "<algorithm>:<hex>": sha256 (hub LFS files, OCI layers, https), md5 (single-part S3
# ETags), s3etag (multipart S3 ETags, "md5-of-part-md5s-<parts>"), gitsha1 (hub files kept
# in git, whose id is the sha1 of "blob <size>\0" + content).
DIGEST = re.compile(
    r"^(sha256:[0-9a-f]{64}|md5:[0-9a-f]{32}|s3etag:[0-9a-f]{32}-\d{1,5}|gitsha1:[0-9a-f]{40})$"
)
Progress = Callable[[int], None]  # bytes just written


class RemoteFile(BaseModel):
    """One file of a model as its store describes it."""

    model_config = ConfigDict(frozen=True)

    name: str  # relative path inside the model directory
    size: int = Field(ge=0)
    digest: str = Field(pattern=DIGEST.pattern)
    ref: str = ""  # what the store calls it (an S3 key, an OCI blob digest)
    part_size: int | None = None  # S3 multipart: the size of each part, to check the ETag


class Listing(BaseModel):
    """A model's files and what the store pinned them to (a commit, a manifest digest)."""

    files: list[RemoteFile]
    pinned: str = ""


def safe_name(name: str, uri: str) -> str:
    """A store's file name as a relative path that cannot leave the model directory."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or any(p in ("", ".", "..") for p in path.parts) or "\\" in name:
        raise BadModelUri(f"{uri}: the store lists an unsafe file name {name!r}")
    return str(path)


class Source(ABC):
    """A model store client for one URI."""

    scheme: ClassVar[str]

    def __init__(self, uri: str) -> None:
        self.uri = uri

    @property
    @abstractmethod
    def canonical(self) -> str:
        """The URI normalised, so two spellings of one model share a cache entry."""

    @abstractmethod
    def listing(self) -> Listing:
        """The model's files (network)."""

    @abstractmethod
    def fetch(self, file: RemoteFile, part: Path, progress: Progress) -> None:
        """Append `file`'s bytes from `part`'s current size to its end."""

    def pinned_uri(self, listing: Listing) -> str:
        """The URI naming exactly what `listing` holds (hf: the commit); default unchanged."""
        return self.canonical


def match_uri(pattern: re.Pattern[str], uri: str, form: str) -> re.Match[str]:
    """`uri` parsed by its scheme's pattern, or BadModelUri saying the form it should take."""
    m = pattern.match(uri)
    if m is None:
        raise BadModelUri(f"{uri!r}: expected {form}")
    return m
