"""Which replicas hold which prefix blocks: the gateway's view of every engine's prefix
cache, fed by the engines' KV events (`fleet.v1.kvcache.<cluster>`).

Keys are block keys: the first 8 bytes (big-endian) of the engine's chained sha256 block
hash (`fleet_base.block_hash`), or a trace's hash ids in the simulator. A collision
(~n^2 / 2^64) can only misroute a request, never change an answer.

Safety over recall: the index may forget blocks a replica still holds (bounded memory
drops the oldest; a gap in a replica's sequence numbers drops all of that replica's
blocks until its full set arrives again), but it never claims a block after the event
that evicted it was applied. Pure and synchronous; the caller does the I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["applied", "stale", "resync"]


def block_key(block_hash: bytes) -> int:
    """The index key of an engine block hash."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass
class _Replica:
    deployment: str
    epoch: str = ""
    seq: int = -1  # last sequence number applied; -1: nothing trusted yet
    block_size: int = 0
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)


@dataclass(frozen=True)
class KvUpdate:
    """One batch of a replica's events, in the order the engine made them."""

    cluster: str
    replica_id: str
    deployment: str
    epoch: str  # changes when the replica (or its relay) restarts
    seq: int  # consecutive within an epoch
    ops: tuple[tuple[str, tuple[int, ...]], ...] = ()  # ("stored"|"removed"|"cleared", keys), in order
    snapshot: bool = False  # the ops give the replica's full set: replace, then trust
    block_size: int = 0


class PrefixIndex:
    """(cluster, replica) -> the block keys it holds, bounded per replica and in replicas."""

    def __init__(self, max_blocks_per_replica: int = 65536, max_replicas: int = 4096) -> None:
        if max_blocks_per_replica < 1 or max_replicas < 1:
            raise ValueError("index bounds must be positive")
        self.max_blocks = max_blocks_per_replica
        self.max_replicas = max_replicas
        self._replicas: OrderedDict[tuple[str, str], _Replica] = OrderedDict()

    # ------------------------------------------------------------------ reads

    def match(self, cluster: str, replica_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the replica holds."""
        r = self._replicas.get((cluster, replica_id))
        if r is None:
            return 0
        n = 0
        for h in hashes:
            if h not in r.blocks:
                break
            n += 1
        return n

    def replicas(self, cluster: str, deployment: str) -> tuple[str, ...]:
        return tuple(
            rid for (c, rid), r in self._replicas.items() if c == cluster and r.deployment == deployment
        )

    def block_size(self, deployment: str) -> int | None:
        for r in self._replicas.values():
            if r.deployment == deployment and r.block_size:
                return r.block_size
        return None

    def holds(self, cluster: str, replica_id: str, key: int) -> bool:
        r = self._replicas.get((cluster, replica_id))
        return r is not None and key in r.blocks

    @property
    def size(self) -> int:
        """Block entries held, over every replica."""
        return sum(len(r.blocks) for r in self._replicas.values())

    def __len__(self) -> int:
        return len(self._replicas)

    # ------------------------------------------------------------------ writes

    def apply(self, update: KvUpdate) -> Outcome:
        """Apply one batch. "resync": the batch does not follow the last one applied (a
        restart, a lost message, or the first delta heard): the replica's blocks are
        dropped and its full set should be asked for. "stale": an old duplicate, ignored."""
        key = (update.cluster, update.replica_id)
        r = self._replicas.get(key)
        if update.snapshot:
            r = self._entry(key, update.deployment)
            r.blocks.clear()
            r.epoch, r.seq = update.epoch, update.seq
            r.block_size = update.block_size or r.block_size
            self._run(r, update.ops)
            return "applied"
        if r is None or r.seq < 0 or r.epoch != update.epoch or update.seq > r.seq + 1:
            r = self._entry(key, update.deployment)
            r.blocks.clear()
            r.epoch, r.seq = update.epoch, -1
            return "resync"
        if update.seq <= r.seq:
            return "stale"
        self._replicas.move_to_end(key)
        r.seq = update.seq
        r.block_size = update.block_size or r.block_size
        self._run(r, update.ops)
        return "applied"

    def forget(self, cluster: str, replica_id: str) -> None:
        self._replicas.pop((cluster, replica_id), None)

    def keep_only(self, cluster: str, replica_ids: Iterable[str]) -> None:
        """Drop a cluster's replicas that are gone (the caller knows which still run)."""
        keep = set(replica_ids)
        for key in [k for k in self._replicas if k[0] == cluster and k[1] not in keep]:
            del self._replicas[key]

    def _run(self, r: _Replica, ops: Iterable[tuple[str, Sequence[int]]]) -> None:
        for kind, keys in ops:
            if kind == "cleared":
                r.blocks.clear()
            elif kind == "stored":
                self._store(r, keys)
            else:
                for k in keys:
                    r.blocks.pop(k, None)

    def _entry(self, key: tuple[str, str], deployment: str) -> _Replica:
        r = self._replicas.get(key)
        if r is None:
            r = self._replicas[key] = _Replica(deployment)
            while len(self._replicas) > self.max_replicas:
                self._replicas.popitem(last=False)
        r.deployment = deployment
        self._replicas.move_to_end(key)
        return r

    def _store(self, r: _Replica, keys: Iterable[int]) -> None:
        blocks = r.blocks
        for k in keys:
            blocks[k] = None
            blocks.move_to_end(k)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
