"""Publishing desired state, routes and keys to the JetStream KV buckets: only what
changed, with a `generation` that only goes up.

What counts as a change is the serialized content without `generation` and
`updated_at`. A write's generation is the bucket stream's next sequence number (the
KV revision it gets), so generations rise across control-plane restarts and even for
a key deleted and written again, with no counter in the database; the highest
generation this process saw per key is a floor on top, for a NATS that lost its store.
After every (re)connect the publisher re-reads the buckets and repairs whatever
differs: missing keys are written again, keys nobody wants any more are deleted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

from pydantic import BaseModel, ValidationError

from fleet_base import api_keys, protocol
from fleet_base.nats_io import NatsLink

log = logging.getLogger(__name__)

BUCKET_MODELS: dict[str, type[protocol.Message]] = {
    protocol.BUCKET_DESIRED: protocol.DesiredState,
    protocol.BUCKET_ROUTES: protocol.RoutingTable,
    protocol.BUCKET_KEYS: api_keys.ApiKeyRecord,
}
VOLATILE = {"generation", "updated_at"}


def content_of(message: BaseModel) -> str:
    """The part of a message that decides whether it changed."""
    return message.model_dump_json(exclude=VOLATILE & set(type(message).model_fields))


def with_generation(message: protocol.Message, generation: int, now: float) -> protocol.Message:
    fields = type(message).model_fields
    update = {k: v for k, v in (("generation", generation), ("updated_at", now)) if k in fields}
    return message.model_copy(update=update) if update else message


class _Entry(BaseModel):
    content: str | None  # None: present in the bucket but unreadable (rewrite it)
    generation: int = 0


class KvPublisher:
    """Keeps the three buckets equal to what the reconcile loop wants. Not thread-safe:
    one task (the reconcile loop) calls `publish`."""

    def __init__(self, link: NatsLink, buckets: tuple[str, ...] = tuple(BUCKET_MODELS)) -> None:
        self.link = link
        self.buckets = buckets
        self._known: dict[str, dict[str, _Entry]] = {b: {} for b in buckets}
        # The highest generation this process saw per key, also of keys deleted or lost since.
        self._floor: dict[tuple[str, str], int] = {}
        self._last_seq: dict[str, int] = {b: 0 for b in buckets}
        self._loaded = False
        self.puts = 0
        self.deletes = 0

    def invalidate(self) -> None:
        """Forget what the buckets hold (after a reconnect): the next publish re-reads them."""
        self._loaded = False

    async def _load(self) -> None:
        for bucket, entries in self._known.items():  # a NATS that lost its store must not lower them
            for key, entry in entries.items():
                self._floor[(bucket, key)] = max(self._floor.get((bucket, key), 0), entry.generation)
        known: dict[str, dict[str, _Entry]] = {}
        for bucket in self.buckets:
            model = BUCKET_MODELS[bucket]
            items, last_seq = await bucket_items(self.link, bucket)
            known[bucket] = {key: _read(model, raw) for key, raw in items.items()}
            self._last_seq[bucket] = max(self._last_seq[bucket], last_seq)
        self._known = known
        self._loaded = True

    def raise_floor(self, bucket: str, key: str, generation: int) -> None:
        """A generation the key is known to have reached elsewhere (an agent's heartbeat
        reports the desired generation it applied): the next write goes above it, so an
        agent never sees a lower generation after both NATS and this process lost theirs."""
        if generation > self._floor.get((bucket, key), 0):
            self._floor[(bucket, key)] = generation

    def generation(self, bucket: str, key: str) -> int:
        entry = self._known[bucket].get(key)
        return max(entry.generation if entry else 0, self._floor.get((bucket, key), 0))

    async def publish(self, wanted: Mapping[str, Mapping[str, protocol.Message]]) -> bool:
        """Write changed keys and delete unwanted ones in the buckets named in `wanted`.
        False when NATS is down or a write failed (the next call retries)."""
        if not self.link.is_connected:
            return False
        try:
            if not self._loaded:
                await self._load()
        except Exception as err:
            log.warning("could not read the KV buckets: %s", err)
            return False
        ok = True
        now = time.time()
        for bucket, items in wanted.items():
            known = self._known[bucket]
            for key in sorted(items):
                message = items[key]
                content = content_of(message)
                entry = known.get(key)
                if entry is not None and entry.content == content:
                    continue
                generation = max(self.generation(bucket, key), self._last_seq[bucket]) + 1
                revision = await self._put(bucket, key, with_generation(message, generation, now))
                if revision is None:
                    ok = False
                    continue
                self._last_seq[bucket] = max(self._last_seq[bucket], revision)
                known[key] = _Entry(content=content, generation=generation)
                self.puts += 1
            for key in sorted(set(known) - set(items)):
                if await self.link.kv_delete(bucket, key):
                    self._floor[(bucket, key)] = self.generation(bucket, key)
                    self._last_seq[bucket] += 1  # the delete marker takes a sequence number
                    known.pop(key)
                    self.deletes += 1
                else:
                    ok = False
        if not ok:
            self._loaded = False  # re-read before the retry: a half-done write leaves no doubt
        return ok

    async def _put(self, bucket: str, key: str, message: protocol.Message) -> int | None:
        """The revision of the write, None when it failed (NATS down: the next call retries)."""
        if not self.link.is_connected:
            return None
        try:
            return int(await (await self.link.kv(bucket)).put(key, message.to_bytes()))
        except Exception as err:
            log.warning("kv put %s/%s failed: %s", bucket, key, err)
            return None


async def bucket_items(link: NatsLink, bucket: str) -> tuple[dict[str, bytes], int]:
    """Every live key of a bucket and the bucket stream's last sequence (see
    `NatsLink.kv_snapshot`: it never trusts nats-py's `keys()`, which can miss keys)."""
    return await link.kv_snapshot(bucket)


def _read(model: type[protocol.Message], raw: bytes) -> _Entry:
    try:
        generation = int(json.loads(raw).get("generation", 0))
    except (ValueError, AttributeError, TypeError):
        generation = 0
    try:
        return _Entry(content=content_of(model.from_bytes(raw)), generation=generation)
    except (ValidationError, ValueError):
        return _Entry(content=None, generation=generation)
