"""Publishing desired state, routes and keys to the JetStream KV buckets: only what
changed, with a `generation` that only goes up, under the leader's fencing epoch.

What counts as a change is the serialized content without `generation` and
`updated_at`. A write's generation is the bucket stream's next sequence number (the
KV revision it gets), so generations rise across control-plane restarts and even for
a key deleted and written again, with no counter in the database; the highest
generation this process saw per key is a floor on top, for a NATS that lost its store.
After every (re)connect the publisher re-reads the buckets and repairs whatever
differs: missing keys are written again, keys nobody wants any more are deleted.

Fencing. Every value carries `epoch`, the leader's (`ControlPlaneContext.epoch`), and
the epoch is part of the content, so a new leader's first publish rewrites every key
under its epoch and agents learn it (they refuse lower epochs: agent.fencing). A paused
old leader that wakes up must not make its stale view stick in the bucket either (an
agent that starts afresh would obey it). Three rules make that so:

- Every write and delete is a compare-and-set on the revision this publisher last saw
  of the key (`NatsLink.kv_cas`). A lost race re-reads the key: written under a higher
  epoch, this publisher is fenced; else (a lower or equal epoch, or gone) it writes over
  it at the revision it just read. So once the newer leader wrote a key, the old one can
  neither overwrite nor delete it, and a stale write that landed first is overwritten.
- Before each publish the publisher compares each bucket stream's last sequence with
  the one its own writes left; when someone else wrote since, it re-reads the bucket.
  So a key the old leader created, or wrote before the newer leader loaded it, is
  repaired (overwritten or deleted) at the newer leader's next publish, not only after
  a reconnect.
- A bucket holding any value of a higher epoch than this publisher's fences it for
  good: it writes and deletes nothing there any more (`fenced`), says so once, and tells
  `on_newer_epoch`: the elector either finds a successor in the database and steps down,
  or finds the database behind the wire (it lost its history) and leads again above it.

What remains: between the newer leader's publishes, an old leader's create of a key the
newer one does not want (or its write racing the newer leader's load) stays visible for
up to one publish interval; agents that saw the newer epoch refuse it meanwhile.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ValidationError

from fleet_base import api_keys, protocol
from fleet_base.nats_io import KvConflict, NatsLink

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


def with_epoch(message: protocol.Message, epoch: int) -> protocol.Message:
    """`message` under the publisher's fencing epoch (messages without one as they are)."""
    if "epoch" not in type(message).model_fields or getattr(message, "epoch", None) == epoch:
        return message
    return message.model_copy(update={"epoch": epoch})


class _Entry(BaseModel):
    content: str | None  # None: present in the bucket but unreadable (rewrite it)
    generation: int = 0
    revision: int = 0  # the key's KV revision when this publisher last saw or wrote it
    epoch: int = 0


class _Fenced(Exception):
    """The bucket holds a value of a newer leader's epoch."""


class KvPublisher:
    """Keeps the three buckets equal to what the reconcile loop wants, under `epoch`.
    Not thread-safe: one task (the reconcile loop) calls `publish`."""

    def __init__(
        self,
        link: NatsLink,
        buckets: tuple[str, ...] = tuple(BUCKET_MODELS),
        epoch: int = 0,
        on_newer_epoch: Callable[[int, str], None] | None = None,
    ) -> None:
        self.link = link
        self.on_newer_epoch = on_newer_epoch  # (epoch, where): a bucket newly fenced
        self.buckets = buckets
        self.epoch = epoch
        self._known: dict[str, dict[str, _Entry]] = {b: {} for b in buckets}
        # The revision of the delete marker of each key this publisher deleted since its last
        # read of the bucket: the revision a write that recreates the key expects.
        self._deleted: dict[str, dict[str, int]] = {b: {} for b in buckets}
        # The highest generation this process saw per key, also of keys deleted or lost since.
        self._floor: dict[tuple[str, str], int] = {}
        self._last_seq: dict[str, int] = {b: 0 for b in buckets}
        # Each bucket stream's last sequence as this publisher left it (None: unknown):
        # another value means someone else wrote there since, and the bucket is re-read.
        self._stream_seq: dict[str, int | None] = {b: None for b in buckets}
        # The highest epoch read in each bucket; above `epoch`, the bucket is fenced.
        self.seen_epoch: dict[str, int] = {b: 0 for b in buckets}
        self._loaded = False
        self.puts = 0
        self.deletes = 0
        self.conflicts = 0  # compare-and-set writes that lost a race (re-read, then repaired or fenced)
        self.loads = 0  # full re-reads of the buckets

    def fenced(self, bucket: str) -> bool:
        """Whether a newer leader wrote `bucket`: this publisher writes nothing there."""
        return self.seen_epoch[bucket] > self.epoch

    def invalidate(self) -> None:
        """Forget what the buckets hold (after a reconnect): the next publish re-reads them."""
        self._loaded = False

    def _see_epoch(self, bucket: str, epoch: int) -> None:
        if epoch > self.seen_epoch[bucket]:
            if epoch > self.epoch and not self.fenced(bucket):
                log.warning(
                    "%s holds values of epoch %d, newer than ours (%d): another control plane "
                    "leads; writing nothing there any more",
                    bucket,
                    epoch,
                    self.epoch,
                )
            self.seen_epoch[bucket] = epoch
            if epoch > self.epoch and self.on_newer_epoch is not None:
                self.on_newer_epoch(epoch, f"bucket {bucket}")

    async def _load(self) -> None:
        for bucket, entries in self._known.items():  # a NATS that lost its store must not lower them
            for key, entry in entries.items():
                self._floor[(bucket, key)] = max(self._floor.get((bucket, key), 0), entry.generation)
        known: dict[str, dict[str, _Entry]] = {}
        for bucket in self.buckets:
            model = BUCKET_MODELS[bucket]
            items, last_seq = await self.link.kv_revisions(bucket)
            known[bucket] = {key: _read(model, raw, revision) for key, (raw, revision) in items.items()}
            for entry in known[bucket].values():
                self._see_epoch(bucket, entry.epoch)
            self._last_seq[bucket] = max(self._last_seq[bucket], last_seq)
            self._stream_seq[bucket] = last_seq
        self._known = known
        self._deleted = {b: {} for b in self.buckets}
        self._loaded = True
        self.loads += 1

    async def _moved(self) -> bool:
        """Whether anyone else wrote a bucket since this publisher's last write or read."""
        for bucket in self.buckets:
            if await self.link.kv_last_seq(bucket) != self._stream_seq[bucket]:
                return True
        return False

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
        False when NATS is down, a write failed (the next call retries) or a bucket is
        fenced (a newer leader's: never retried by this publisher)."""
        if not self.link.is_connected or all(self.fenced(b) for b in wanted):
            return False
        try:
            if self._loaded and await self._moved():
                self._loaded = False
            if not self._loaded:
                await self._load()
        except Exception as err:
            log.warning("could not read the KV buckets: %s", err)
            return False
        ok = True
        now = time.time()
        for bucket, items in wanted.items():
            try:
                ok = await self._publish_bucket(bucket, items, now) and ok
            except _Fenced:
                ok = False
        if not ok:
            self._loaded = False  # re-read before the retry: a half-done write leaves no doubt
        return ok

    async def _publish_bucket(self, bucket: str, items: Mapping[str, protocol.Message], now: float) -> bool:
        if self.fenced(bucket):
            raise _Fenced(bucket)
        ok = True
        known = self._known[bucket]
        for key in sorted(items):
            message = with_epoch(items[key], self.epoch)
            content = content_of(message)
            entry = known.get(key)
            if entry is not None and entry.content == content:
                continue
            generation = max(self.generation(bucket, key), self._last_seq[bucket]) + 1
            data = with_generation(message, generation, now).to_bytes()
            last = entry.revision if entry else self._deleted[bucket].get(key, 0)
            revision = await self._write(bucket, key, data, last)
            if revision is None:
                ok = False
                continue
            self._last_seq[bucket] = max(self._last_seq[bucket], revision)
            self._deleted[bucket].pop(key, None)
            generation = max(generation, self._floor.get((bucket, key), 0) + 1)  # as `_write` wrote it
            known[key] = _Entry(content=content, generation=generation, revision=revision, epoch=self.epoch)
            self.puts += 1
        for key in sorted(set(known) - set(items)):
            revision = await self._write(bucket, key, None, known[key].revision)
            if revision is None:
                ok = False
                continue
            self._floor[(bucket, key)] = self.generation(bucket, key)
            self._last_seq[bucket] = max(self._last_seq[bucket], revision)
            known.pop(key)
            self._deleted[bucket][key] = revision
            self.deletes += 1
        return ok

    async def _write(self, bucket: str, key: str, data: bytes | None, last: int) -> int | None:
        """Put `data` (None: delete) if the key is still at revision `last`; on a lost race,
        re-read the key and write over it unless a newer epoch holds it (`_Fenced`). The
        new revision, None when the write failed (NATS down: the next call retries)."""
        if not self.link.is_connected:
            return None
        try:
            for attempt in range(2):
                try:
                    revision = await self.link.kv_cas(bucket, key, data, last)
                except KvConflict:
                    if attempt:
                        raise
                    self.conflicts += 1
                    raw, last = await self.link.kv_entry(bucket, key)
                    if raw is not None:
                        current = _read(BUCKET_MODELS[bucket], raw, last)
                        self._see_epoch(bucket, current.epoch)
                        self.raise_floor(bucket, key, current.generation)
                    if self.fenced(bucket):
                        raise _Fenced(bucket) from None
                    if raw is None and data is None:
                        return last  # already gone
                    if data is not None:  # above whatever generation the other writer used
                        data = _regenerated(data, self._floor.get((bucket, key), 0))
                    continue
                if self._stream_seq[bucket] is not None:
                    # our own write moved the stream: expected unless someone else wrote too
                    expected = self._stream_seq[bucket] + 1 == revision
                    self._stream_seq[bucket] = revision if expected else None
                return revision
        except _Fenced:
            raise
        except Exception as err:
            log.warning("kv %s %s/%s failed: %s", "delete" if data is None else "put", bucket, key, err)
        return None


async def bucket_items(link: NatsLink, bucket: str) -> tuple[dict[str, bytes], int]:
    """Every live key of a bucket and the bucket stream's last sequence (see
    `NatsLink.kv_snapshot`: it never trusts nats-py's `keys()`, which can miss keys)."""
    return await link.kv_snapshot(bucket)


def _regenerated(data: bytes, floor: int) -> bytes:
    """`data` with its generation (where it has one) above `floor`."""
    fields = json.loads(data)
    if "generation" not in fields or fields["generation"] > floor:
        return data
    return json.dumps({**fields, "generation": floor + 1}, separators=(",", ":")).encode()


def _read(model: type[protocol.Message], raw: bytes, revision: int = 0) -> _Entry:
    try:
        fields = json.loads(raw)
        generation, epoch = int(fields.get("generation", 0)), int(fields.get("epoch", 0))
    except (ValueError, AttributeError, TypeError):
        generation, epoch = 0, 0
    try:
        content: str | None = content_of(model.from_bytes(raw))
    except (ValidationError, ValueError):
        content = None
    return _Entry(content=content, generation=generation, revision=revision, epoch=epoch)
