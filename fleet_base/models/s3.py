"""`s3://bucket/key` (one object) or `s3://bucket/prefix/` (every object under it).

boto3 with the standard credential chain (env, shared config, instance roles) and
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for S3-compatible stores (MinIO, R2, GCS
interop). Checked by ETag: the MD5 of a single-part object, or the MD5 of the part MD5s
of a multipart one (part size from `HeadObject` of part 1). Downloads resume with
`Range` and are pinned to the listed ETag with `IfMatch`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fleet_base.models.errors import (
    BadModelUri,
    MissingObject,
    ModelStoreError,
    NoCredentials,
    StoreUnreachable,
)
from fleet_base.models.source import Listing, Progress, RemoteFile, Source, match_uri, safe_name
from fleet_base.models.transfer import resume_offset, store_errors, write_chunks

_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<key>[^\x00-\x1f\x7f]*)$")
_ETAG = re.compile(r'^"?(?P<md5>[0-9a-f]{32})(?:-(?P<parts>\d+))?"?$')
CHUNK = 256 << 10
MAX_OBJECTS = 10_000


def _client() -> Any:
    import boto3
    from botocore.config import Config

    # A fresh session reads the credential chain now (the default session caches it).
    session = boto3.session.Session()
    return session.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))


def _error(err: Exception, what: str) -> ModelStoreError:
    """botocore's exceptions as the cache's reasons."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(err, NoCredentialsError):
        return NoCredentials(
            f"{what}: no AWS credentials in this environment (AWS_ACCESS_KEY_ID, a profile or a role)"
        )
    if isinstance(err, EndpointConnectionError):
        return StoreUnreachable(f"{what}: {err}")
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
            return MissingObject(f"{what}: {code}")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return NoCredentials(f"{what}: access denied ({code})")
        if code in ("PreconditionFailed", "412"):
            return ModelStoreError(f"{what}: the object changed during the download")
        return ModelStoreError(f"{what}: S3 error {code or status}")
    if isinstance(err, OSError | ConnectionError):
        return StoreUnreachable(f"{what}: {err}")
    return ModelStoreError(f"{what}: {err}")


def _digest(etag: str) -> str:
    m = _ETAG.match(etag)
    if m is None:  # e.g. SSE-KMS objects, whose ETag is no MD5
        raise ModelStoreError(f"ETag {etag!r} is not an MD5; cannot verify the object")
    return f"s3etag:{m['md5']}-{m['parts']}" if m["parts"] else f"md5:{m['md5']}"


class S3Source(Source):
    """One S3 object, or every object under a prefix, checked against their ETags."""

    scheme = "s3"

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        m = match_uri(_URI, uri, "s3://bucket/key or s3://bucket/prefix/")
        self.bucket, self.key = m["bucket"], m["key"]
        self._s3: Any = None

    @property
    def canonical(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = _client()
        return self._s3

    def _file(self, key: str, name: str, size: int, etag: str) -> RemoteFile:
        digest = _digest(etag)
        part_size = None
        if digest.startswith("s3etag:"):
            try:
                part_size = int(
                    self.s3.head_object(Bucket=self.bucket, Key=key, PartNumber=1)["ContentLength"]
                )
            except Exception as err:
                raise _error(err, f"s3://{self.bucket}/{key}") from err
        return RemoteFile(
            name=safe_name(name, self.uri), size=size, digest=digest, ref=key, part_size=part_size
        )

    def listing(self) -> Listing:
        if self.key and not self.key.endswith("/"):
            try:
                head = self.s3.head_object(Bucket=self.bucket, Key=self.key)
            except Exception as err:
                failure = _error(err, self.canonical)
                if not isinstance(failure, MissingObject):
                    raise failure from err
            else:
                name = self.key.rsplit("/", 1)[-1]
                file = self._file(self.key, name, int(head["ContentLength"]), head["ETag"])
                return Listing(files=[file], pinned=head["ETag"].strip('"'))
        prefix = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        files: list[RemoteFile] = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if not name or name.endswith("/"):
                        continue
                    files.append(self._file(obj["Key"], name, int(obj["Size"]), obj["ETag"]))
                    if len(files) > MAX_OBJECTS:
                        raise BadModelUri(f"{self.uri}: more than {MAX_OBJECTS} objects under the prefix")
        except ModelStoreError:
            raise
        except Exception as err:
            raise _error(err, self.canonical) from err
        if not files:
            raise MissingObject(f"{self.canonical}: no such object, and no objects under {prefix!r}")
        return Listing(files=sorted(files, key=lambda f: f.name))

    def fetch(self, file: RemoteFile, part: Path, progress: Progress) -> None:
        offset = resume_offset(part, file)
        if offset == file.size:
            return
        etag = file.digest.split(":", 1)[1].split("-")[0]
        etag = (
            f'"{etag}-{file.digest.rsplit("-", 1)[1]}"' if file.digest.startswith("s3etag:") else f'"{etag}"'
        )
        with store_errors(_error, f"s3://{self.bucket}/{file.ref}"):
            body = self.s3.get_object(
                Bucket=self.bucket, Key=file.ref, Range=f"bytes={offset}-", IfMatch=etag
            )["Body"]
            write_chunks(part, "ab", body.iter_chunks(CHUNK), progress)
