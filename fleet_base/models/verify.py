"""Checksums of a downloaded file in one pass: its sha256 (the cache's content address)
and whatever the store vouched for (md5, an S3 multipart ETag, a git blob sha1)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fleet_base.models.errors import ChecksumMismatch
from fleet_base.models.source import RemoteFile

READ = 8 << 20


def check_file(path: Path, file: RemoteFile) -> str:
    """The sha256 hex of `path` once it matches `file`'s size and digest; ChecksumMismatch if not."""
    size = path.stat().st_size
    if size != file.size:
        raise ChecksumMismatch(f"{file.name}: {size} bytes, the store says {file.size}")
    algo, expected = file.digest.split(":", 1)
    sha = hashlib.sha256()
    other = None
    if algo == "md5":
        other = hashlib.md5(usedforsecurity=False)
    elif algo == "gitsha1":
        other = hashlib.sha1(usedforsecurity=False)
        other.update(f"blob {size}\0".encode())
    parts: list[bytes] = []
    part = hashlib.md5(usedforsecurity=False)
    in_part = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ):
            sha.update(chunk)
            if other is not None:
                other.update(chunk)
            if algo == "s3etag":
                step = file.part_size or size or 1
                view = memoryview(chunk)
                while view:
                    take = min(len(view), step - in_part)
                    part.update(view[:take])
                    in_part += take
                    view = view[take:]
                    if in_part == step:
                        parts.append(part.digest())
                        part, in_part = hashlib.md5(usedforsecurity=False), 0
    if algo == "sha256":
        got = sha.hexdigest()
    elif algo == "s3etag":
        if in_part:
            parts.append(part.digest())
        got = f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"
    else:
        assert other is not None
        got = other.hexdigest()
    if got != expected:
        raise ChecksumMismatch(f"{file.name}: {algo} is {got}, the store says {expected}; discarded")
    return sha.hexdigest()
