"""KV events: which prefix blocks became cached (full and hashed) or were evicted, in
the engine's chained-hash scheme, batched and numbered for a reader outside the engine.

The block pool records on the engine thread; a reader (the server's `/kv/events`, for
the agent's relay) takes everything since its last sequence number, or, when it is new,
restarted (`epoch`), or fell behind the kept batches, the full set of cached hashes (a
snapshot). Every op names its tier: "device" (the KV pool the model reads) or "host" (the
offloading tier below it, `engine.kv_cache.host_tier`; vLLM's events call it the medium).
Memory is bounded: at most `max_batches` sealed batches and `max_pending` unread events;
past that the backlog is dropped and readers get a snapshot instead.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from fleet_base.block_hash import BlockHash
from fleet_base.kv_events import TIERS, Tier

Kind = Literal["stored", "removed", "cleared"]
Op = tuple[Kind, list[BlockHash], Tier]


@dataclass
class KvEventsRead:
    """What one read returns: ops after `after` up to `seq`, or a snapshot at `seq`."""

    epoch: str
    seq: int
    snapshot: bool
    ops: list[Op] = field(default_factory=list)


class KvEventLog:
    def __init__(self, block_size: int, max_batches: int = 256, max_pending: int = 1 << 18) -> None:
        self.block_size = block_size
        self.epoch = secrets.token_hex(8)  # a restarted engine is a new epoch
        self.max_batches = max_batches
        self.max_pending = max_pending
        self._lock = threading.Lock()
        # mirror of what each tier caches, for snapshots
        self._cached: dict[Tier, set[BlockHash]] = {t: set() for t in TIERS}
        self._pending: list[Op] = []
        self._pending_n = 0
        self._batches: deque[tuple[int, list[Op]]] = deque()
        self._seq = 0  # last sealed batch (0: the empty start)

    # ------------------------------------------------------------------ engine thread

    def stored(self, block_hash: BlockHash, tier: Tier = "device") -> None:
        with self._lock:
            self._cached[tier].add(block_hash)
            self._add("stored", block_hash, tier)

    def removed(self, block_hash: BlockHash, tier: Tier = "device") -> None:
        with self._lock:
            self._cached[tier].discard(block_hash)
            self._add("removed", block_hash, tier)

    def cleared(self) -> None:
        """Every tier was emptied."""
        with self._lock:
            for hashes in self._cached.values():
                hashes.clear()
            self._pending.append(("cleared", [], "device"))
            self._pending_n += 1

    def _add(self, kind: Kind, block_hash: BlockHash, tier: Tier) -> None:
        if self._pending and self._pending[-1][0] == kind and self._pending[-1][2] == tier:
            self._pending[-1][1].append(block_hash)
        else:
            self._pending.append((kind, [block_hash], tier))
        self._pending_n += 1
        if self._pending_n > self.max_pending:  # nobody reads: forget the backlog
            self._pending.clear()
            self._pending_n = 0
            self._batches.clear()
            self._seq += 1

    # ------------------------------------------------------------------ readers

    def has_news(self, epoch: str | None, after: int | None) -> bool:
        with self._lock:
            return epoch != self.epoch or after is None or bool(self._pending) or after != self._seq

    def read(self, epoch: str | None, after: int | None) -> KvEventsRead:
        with self._lock:
            if self._pending:
                self._batches.append((self._seq + 1, self._pending))
                self._seq += 1
                self._pending = []
                self._pending_n = 0
                while len(self._batches) > self.max_batches:
                    self._batches.popleft()
            oldest = self._batches[0][0] if self._batches else self._seq + 1
            if epoch != self.epoch or after is None or after > self._seq or after < oldest - 1:
                snap: list[Op] = [("stored", sorted(self._cached["device"]), "device")]
                if self._cached["host"]:
                    snap.append(("stored", sorted(self._cached["host"]), "host"))
                return KvEventsRead(self.epoch, self._seq, True, snap)
            ops = [op for seq, batch in self._batches if seq > after for op in batch]
            return KvEventsRead(self.epoch, self._seq, False, ops)

    @property
    def num_cached(self) -> int:
        """Blocks cached on the device."""
        with self._lock:
            return len(self._cached["device"])
