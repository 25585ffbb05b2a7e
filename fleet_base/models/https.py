"""`https://host/path/model.gguf#sha256=<hex>`: one file, checked against the sha256 the
URI carries (required: a plain URL says nothing about what it serves). httpx, resuming
with `Range`; `http://` is accepted on the same terms (the sha256 is what protects it)."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import httpx

from fleet_base.models.errors import (
    BadModelUri,
    MissingObject,
    ModelStoreError,
    NoCredentials,
    StoreUnreachable,
)
from fleet_base.models.source import Listing, Progress, RemoteFile, Source, safe_name
from fleet_base.models.transfer import resume_offset, store_errors, write_chunks

_FRAGMENT = re.compile(r"^sha256=(?P<hex>[0-9a-fA-F]{64})$")
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
_CREDENTIAL_PARAMS = {"x-amz-signature", "x-amz-credential", "x-goog-signature", "sig", "signature", "token"}


def _error(err: Exception, what: str) -> ModelStoreError:
    if isinstance(err, httpx.HTTPStatusError):
        code = err.response.status_code
        if code == 404 or code == 410:
            return MissingObject(f"{what}: HTTP {code}")
        if code in (401, 403):
            return NoCredentials(f"{what}: HTTP {code}")
        return ModelStoreError(f"{what}: HTTP {code}")
    if isinstance(err, httpx.TransportError):
        return StoreUnreachable(f"{what}: {type(err).__name__}: {err}")
    return ModelStoreError(f"{what}: {err}")


class HttpsSource(Source):
    """One file at a URL whose sha256 the URI carries: the server is not trusted to say it."""

    scheme = "https"

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        parts = urlsplit(uri)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise BadModelUri(f"{uri!r}: expected https://host/path#sha256=<64 hex digits>")
        m = _FRAGMENT.match(parts.fragment)
        if m is None:
            raise BadModelUri(
                f"{uri!r}: an https:// model needs its checksum: append #sha256=<64 hex digits>"
            )
        if parts.username or parts.password:
            raise BadModelUri(f"{uri!r}: credentials do not belong in a model URI")
        signed = {k.lower() for k, _ in parse_qsl(parts.query)} & _CREDENTIAL_PARAMS
        if signed:  # a presigned URL would put a credential into the deployment record
            raise BadModelUri(
                f"{parts.scheme}://{parts.netloc}{parts.path}: a signed URL ({', '.join(sorted(signed))}) "
                "carries a credential; name the object by its store URI (s3://...) instead"
            )
        self.sha256 = m["hex"].lower()
        self.url = urlunsplit((parts.scheme, parts.netloc, parts.path, parts.query, ""))
        name = PurePosixPath(parts.path).name or "model"
        self.name = safe_name(name, uri)

    @property
    def canonical(self) -> str:
        return f"{self.url}#sha256={self.sha256}"

    def listing(self) -> Listing:
        try:
            with httpx.Client(timeout=TIMEOUT, follow_redirects=True) as http:
                r = http.head(self.url)
                r.raise_for_status()
        except Exception as err:
            raise _error(err, self.url) from err
        size = r.headers.get("content-length")
        if size is None or not size.isdigit():
            raise ModelStoreError(f"{self.url}: the server does not say how large the file is")
        file = RemoteFile(name=self.name, size=int(size), digest=f"sha256:{self.sha256}", ref=self.url)
        return Listing(files=[file], pinned=self.sha256)

    def fetch(self, file: RemoteFile, part: Path, progress: Progress) -> None:
        offset = resume_offset(part, file)
        if offset == file.size:
            return
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with store_errors(_error, self.url, catch=httpx.HTTPError):
            with httpx.Client(timeout=TIMEOUT, follow_redirects=True) as http:
                with http.stream("GET", file.ref, headers=headers) as r:
                    r.raise_for_status()
                    mode = "ab" if offset and r.status_code == 206 else "wb"  # 200: no ranges, start over
                    write_chunks(part, mode, r.iter_bytes(), progress)
