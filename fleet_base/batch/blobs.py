"""Where file contents live: JetStream's object store (the default, so a fresh install
needs nothing new) or an S3 bucket (`BatchConfig.store_url = "s3://bucket/prefix"`, the
client's usual environment: AWS_ENDPOINT_URL, credentials, region).

boto3 is synchronous: every S3 call runs in a thread so the gateway's event loop never
waits on the network.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from typing import Any
from urllib.parse import urlparse

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from fleet_base.batch import names
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.store import BlobStore, NotFound


class ObjectStoreBlobs:
    """File contents in the JetStream object store bucket `names.OBJECT_BUCKET_FILES`
    (chunked by the client, so a file may exceed the server's message size).

    Reads its chunks itself: nats-py's `ObjectStore.get` looks the stream up by subject
    (`$JS.API.STREAM.NAMES`, a listing a gateway is not permitted) and appends chunk to
    bytes (quadratic in the file's size)."""

    CHUNK_WAIT_S = 30.0  # a stalled read fails instead of hanging

    def __init__(self, js: JetStreamContext, obj: ObjectStore, bucket: str) -> None:
        self.js = js
        self.obj = obj
        self.bucket = bucket

    @classmethod
    async def bind(cls, js: JetStreamContext, bucket: str = names.OBJECT_BUCKET_FILES) -> ObjectStoreBlobs:
        return cls(js, await js.object_store(bucket), bucket)

    async def put(self, name: str, data: bytes) -> None:
        await self.obj.put(name, data)

    async def get(self, name: str) -> bytes:
        try:
            info = await self.obj.get_info(name)
        except NotFoundError as err:  # absent or deleted
            raise NotFound(name) from err
        if not info.size:
            return b""
        sub = await self.js.subscribe(
            f"$O.{self.bucket}.C.{info.nuid}", stream=f"OBJ_{self.bucket}", ordered_consumer=True
        )
        parts: list[bytes] = []
        digest = hashlib.sha256()
        try:
            while True:
                msg = await sub.next_msg(timeout=self.CHUNK_WAIT_S)
                parts.append(msg.data)
                digest.update(msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        expected = base64.urlsafe_b64decode((info.digest or "").split("=", 1)[-1])
        if digest.digest() != expected:
            raise OSError(f"object {name}: content does not match its digest")
        return b"".join(parts)

    async def delete(self, name: str) -> None:
        with contextlib.suppress(NotFoundError):
            await self.obj.delete(name)


def parse_s3_url(url: str) -> tuple[str, str]:
    """("bucket", "prefix/") of `s3://bucket/prefix` (the prefix may be empty)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// url: {url!r}")
    prefix = parsed.path.strip("/")
    return parsed.netloc, f"{prefix}/" if prefix else ""


class S3Blobs:
    """File contents as objects `<prefix><name>` in an S3 bucket."""

    def __init__(self, url: str, client: Any | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        if client is None:
            import boto3  # the S3 path only: a JetStream-only install never imports it

            client = boto3.client("s3")  # endpoint, region, credentials from the environment
        self.client = client

    def _key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    async def put(self, name: str, data: bytes) -> None:
        await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=self._key(name), Body=data)

    async def get(self, name: str) -> bytes:
        def read() -> bytes:
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            except self.client.exceptions.NoSuchKey as err:
                raise NotFound(name) from err
            return response["Body"].read()

        return await asyncio.to_thread(read)

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=self._key(name))


async def blob_store(js: JetStreamContext, config: BatchConfig) -> BlobStore:
    """The blob store `config.store_url` names ("" = the JetStream object store)."""
    if config.store_url:
        return S3Blobs(config.store_url)
    return await ObjectStoreBlobs.bind(js)
