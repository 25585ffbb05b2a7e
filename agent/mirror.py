"""A NATS KV bucket mirrored into memory and the state folder: the agent's desired state,
routes and API keys all arrive this way.

Each entry is decoded with `fleet_base.wire` (a bucket entry's key, not a subject, names
what it is about); a malformed or refused entry is logged and ignored, an entry whose
generation went back is never acted on, nor one written under an older control-plane
epoch than the bucket's highest (agent.fencing). Every accepted change takes effect in memory at
once and is written to the state folder; the copy on disk is loaded first on start, so a
restart while NATS or the control plane is down serves from it.

A write that fails (a full disk) never loses the change: the mirror stays `unsaved`, the
watch does not count the entry as seen (it is delivered again at the next resync) and
`retry_unsaved` writes it as soon as the disk allows. The key set's lease is not
recorded while keys.json is behind memory, so the gateway, which reads keys.json, sees
its key set grow stale (its `stale_keys` rule) instead of trusting a set without a
revocation that could not be written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from agent.fencing import EpochFence
from fleet_base import api_keys, protocol
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.local_state import KeySet, LocalState, RouteSet
from fleet_base.nats_io import KvWatch, NatsLink, RetryLater
from fleet_base.protocol import DesiredState, RoutingTable
from fleet_base.wire import Rejected, decode

log = logging.getLogger("agent")

M = TypeVar("M", bound=protocol.Message)


class NotSaved(RetryLater):
    """An accepted entry took effect in memory but could not be written to disk."""


def decode_entry(model: type[M], key: str, value: bytes) -> M | None:
    """`value` as a `model`, or None (logged) where the wire contract refuses it."""
    try:
        return decode(model, key, value, subject_for=None)
    except Rejected as err:
        log.warning("ignoring %s %r (%s): %s", model.__name__, key, err.reason, err.detail)
        return None


class BucketMirror(Generic[M]):
    """Follow `keys` of `bucket` into `entries` and onto disk (`save`), across reconnects.

    - `refuse(key, entry)`: why an entry is not for us (None: accepted).
    - `generation(entry)`: set where an entry must never go back in generation.
    - `tombstone(key, old)`: what a deletion leaves (None: the entry is removed).
    - `side_keys`: keys that are not entries but signals, handed to their callback.
    - `prune_on_connect`: at every (re)connect, drop entries NATS no longer holds (deleted
      while we were away); off where absence is not deletion.
    - `fence`: refuse entries of an older control-plane epoch than the bucket's highest.
    """

    def __init__(
        self,
        link: NatsLink,
        bucket: str,
        model: type[M],
        *,
        load: Callable[[], dict[str, M]],
        save: Callable[[dict[str, M]], None],
        keys: str = ">",
        refuse: Callable[[str, M], str | None] | None = None,
        generation: Callable[[M], int] | None = None,
        tombstone: Callable[[str, M | None], M] | None = None,
        side_keys: dict[str, Callable[[str, bytes | None], None]] | None = None,
        prune_on_connect: bool = True,
        on_change: Callable[[str, M | None], None] | None = None,
        fence: EpochFence | None = None,
    ) -> None:
        self.link = link
        self.bucket = bucket
        self.model = model
        self.entries: dict[str, M] = {}
        self.unsaved = False  # memory holds changes the copy on disk lacks
        self._load = load
        self._save = save
        self._refuse = refuse
        self._generation = generation
        self._tombstone = tombstone
        self._side_keys = side_keys or {}
        self._on_change = on_change
        self.fence = fence
        self.watch = KvWatch(link, bucket, keys=keys)
        self.watch.subscribe(self.on_entry)
        if prune_on_connect:
            link.on_connect(self.prune)

    def load(self) -> None:
        """Start from the copy on disk."""
        self.entries = dict(self._load())
        if self.fence is not None:  # what was obeyed before fence.json existed
            for entry in self.entries.values():
                self.fence.observe(self.bucket, epoch_of(entry))

    async def on_entry(self, key: str, value: bytes | None) -> None:
        """One update from the bucket: `value` None is a deletion. It takes effect in
        memory first; NotSaved when it could not be written (delivered again later)."""
        if key in self._side_keys:
            self._side_keys[key](key, value)
            return
        entry: M | None
        old = self.entries.get(key)
        if value is None:
            if self._tombstone is not None:
                entry = self._tombstone(key, old)
                self.entries[key] = entry
            elif self.entries.pop(key, None) is None:
                return
            else:
                entry = None
        else:
            entry = decode_entry(self.model, key, value)
            if entry is None or not self._accepts(key, entry):
                return
            self.entries[key] = entry
        self.unsaved = True
        saved = self.persist()
        if self._on_change is not None and (entry is None or entry != old):
            self._on_change(key, entry)
        if not saved:
            raise NotSaved(f"{self.bucket}/{key} applied in memory, not yet on disk")

    def persist(self) -> bool:
        """Write the entries to disk; False (reported by LocalState.writes) when it failed."""
        try:
            self._save(self.entries)
        except OSError:
            self.unsaved = True
            return False
        self.unsaved = False
        return True

    def persist_if_unsaved(self) -> bool:
        """True when the copy on disk is (now) equal to memory."""
        return not self.unsaved or self.persist()

    def _accepts(self, key: str, entry: M) -> bool:
        reason = self._refuse(key, entry) if self._refuse is not None else None
        if reason is not None:
            log.warning("ignoring %s under key %r: %s", self.model.__name__, key, reason)
            return False
        if self.fence is not None and not self.fence.admits(self.bucket, key, epoch_of(entry)):
            return False
        old = self.entries.get(key)
        if self._generation is not None and old is not None:
            # A new leader's epoch outranks any generation an older one wrote.
            before = (epoch_of(old), self._generation(old))
            after = (epoch_of(entry), self._generation(entry))
            if after < before:
                # A replayed or forged older entry: never act on it (a control plane that
                # lost its store still writes higher generations: control_plane.loops.publish).
                log.warning(
                    "ignoring %s %r whose generation went back (%d -> %d)",
                    self.model.__name__,
                    key,
                    before[1],
                    after[1],
                )
                return False
        return True

    async def prune(self) -> None:
        """Drop what disk holds and NATS no longer does (deleted while we were away)."""
        try:
            live = set(await self.link.kv_items(self.bucket))
        except Exception as err:
            log.warning("could not list %s: %s", self.bucket, err)
            return
        gone = [key for key in self.entries if key not in live]
        for key in gone:
            del self.entries[key]
        if gone:
            self.unsaved = True
            self.persist()
            log.info("%s: dropped %d entries deleted while disconnected", self.bucket, len(gone))

    async def close(self) -> None:
        await self.watch.close()


def epoch_of(entry: protocol.Message) -> int:
    return int(getattr(entry, "epoch", 0))


async def retry_unsaved(mirrors: Iterable[BucketMirror], interval_s: float = 1.0) -> None:
    """Write each mirror that memory holds ahead of disk, every `interval_s`, so a change
    reaches disk soon after space comes back (NATS up or not)."""
    mirrors = list(mirrors)
    while True:
        await asyncio.sleep(interval_s)
        for mirror in mirrors:
            mirror.persist_if_unsaved()


def desired_mirror(
    link: NatsLink,
    files: LocalState,
    cluster: str,
    on_change: Callable[[], None],
    fence: EpochFence | None = None,
) -> BucketMirror[DesiredState]:
    """This cluster's desired state (desired.json). Absence is not deletion: with no key at
    connect the copy on disk stays in force; an explicit delete means "run nothing"."""

    def load() -> dict[str, DesiredState]:
        desired = files.load_desired()
        if desired is None or desired.cluster != cluster:
            return {}
        log.info(
            "desired state from disk: generation %d, %d replicas",
            desired.generation,
            len(desired.replicas),
        )
        return {cluster: desired}

    def tombstone(key: str, old: DesiredState | None) -> DesiredState:
        log.info("desired state deleted: running nothing")
        return DesiredState(
            cluster=cluster,
            generation=old.generation if old else 0,
            replicas=[],
            epoch=old.epoch if old else 0,
        )

    def changed(key: str, desired: DesiredState | None) -> None:
        if desired is not None:
            log.info("desired state: generation %d, %d replicas", desired.generation, len(desired.replicas))
        on_change()

    return BucketMirror(
        link,
        protocol.BUCKET_DESIRED,
        DesiredState,
        keys=cluster,
        load=load,
        save=lambda entries: files.save_desired(entries[cluster]) if cluster in entries else None,
        refuse=lambda key, d: None if d.cluster == cluster else f"it is for cluster {d.cluster!r}",
        generation=lambda d: d.generation,
        tombstone=tombstone,
        prune_on_connect=False,
        on_change=changed,
        fence=fence,
    )


def route_mirror(
    link: NatsLink, files: LocalState, fence: EpochFence | None = None
) -> BucketMirror[RoutingTable]:
    """Every deployment's routing table (routes.json), for the gateway."""

    def save(routes: dict[str, RoutingTable]) -> None:
        files.save_routes(RouteSet(routes=routes))

    load = files.load_routes
    return BucketMirror(
        link,
        protocol.BUCKET_ROUTES,
        RoutingTable,
        load=lambda: dict(load().routes),
        save=save,
        fence=fence,
    )


def key_mirror(
    link: NatsLink, files: LocalState, fence: EpochFence | None = None
) -> BucketMirror[ApiKeyRecord]:
    """The API keys (keys.json) and when their lease was last renewed (keys-lease.json)."""

    def lease(key: str, value: bytes | None) -> None:
        renewal = None if value is None else decode_entry(api_keys.KeyLease, key, value)
        if renewal is None:
            return
        if fence is not None and not fence.admits(protocol.BUCKET_KEYS, key, renewal.epoch):
            return  # a deposed leader's renewal vouches for nothing
        # A renewal confirms the key set on disk: never while keys.json lacks a change.
        if not mirror.persist_if_unsaved():
            raise NotSaved("keys.json is behind memory: the lease renewal is not recorded")
        files.save_key_lease(time.time())

    mirror = BucketMirror(
        link,
        protocol.BUCKET_KEYS,
        ApiKeyRecord,
        load=lambda: dict(files.load_keys().keys),
        save=lambda entries: files.save_keys(KeySet(keys=entries)),
        side_keys={api_keys.KEYS_LEASE: lease},
        fence=fence,
    )
    return mirror
