"""KV events: which prefix blocks became cached (full and hashed) or were evicted, in
the engine's chained-hash scheme, batched and numbered for a reader outside the engine.

The block pool records on the engine thread; a reader (the server's `/kv/events`, for
the agent's relay) takes everything since its last sequence number, or, when it is new,
restarted (`epoch`), or fell behind the kept batches, the full set of cached hashes (a
snapshot). Memory is bounded: at most `max_batches` sealed batches and `max_pending`
unread events; past that the backlog is dropped and readers get a snapshot instead.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from fleet_base.block_hash import BlockHash

Kind = Literal["stored", "removed", "cleared"]


@dataclass
class KvEventsRead:
    """What one read returns: ops after `after` up to `seq`, or a snapshot at `seq`."""

    epoch: str
    seq: int
    snapshot: bool
    ops: list[tuple[Kind, list[BlockHash]]] = field(default_factory=list)


class KvEventLog:
    def __init__(self, block_size: int, max_batches: int = 256, max_pending: int = 1 << 18) -> None:
        self.block_size = block_size
        self.epoch = secrets.token_hex(8)  # a restarted engine is a new epoch
        self.max_batches = max_batches
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._cached: set[BlockHash] = set()  # mirror of the pool's cache, for snapshots
        self._pending: list[tuple[Kind, list[BlockHash]]] = []
        self._pending_n = 0
        self._batches: deque[tuple[int, list[tuple[Kind, list[BlockHash]]]]] = deque()
        self._seq = 0  # last sealed batch (0: the empty start)

    # ------------------------------------------------------------------ engine thread

    def stored(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._cached.add(block_hash)
            self._add("stored", block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._cached.discard(block_hash)
            self._add("removed", block_hash)

    def cleared(self) -> None:
        with self._lock:
            self._cached.clear()
            self._pending.append(("cleared", []))
            self._pending_n += 1

    def _add(self, kind: Kind, block_hash: BlockHash) -> None:
        if self._pending and self._pending[-1][0] == kind:
            self._pending[-1][1].append(block_hash)
        else:
            self._pending.append((kind, [block_hash]))
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
                return KvEventsRead(self.epoch, self._seq, True, [("stored", sorted(self._cached))])
            ops = [op for seq, batch in self._batches if seq > after for op in batch]
            return KvEventsRead(self.epoch, self._seq, False, ops)

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cached)
