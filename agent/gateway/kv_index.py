"""Which replicas hold which prefix blocks: the gateway's view of every engine's prefix
cache, fed by the engines' KV events (`fleet.v1.kvcache.<cluster>`).

Keys are block keys: the first 8 bytes (big-endian) of the engine's chained sha256 block
hash (`fleet_base.block_hash`), or a trace's hash ids in the simulator. A collision
(~n^2 / 2^64) can only misroute a request, never change an answer.

Each (replica, block) keeps the tiers that hold it: the device KV pool, the host-memory
tier below it, or both (an offload stores the host copy before the device copy goes). A
removal removes that tier's copy only; the block is forgotten when no tier holds it.

Safety over recall: the index may forget blocks a replica still holds (bounded memory
drops the oldest; a gap in a replica's sequence numbers drops all of that replica's
blocks until its full set arrives again), but it never claims a block (in a tier) after
the event that evicted it (from that tier) was applied. Pure and synchronous; the caller
does the I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["applied", "stale", "resync"]
Tier = Literal["device", "host"]
DEVICE, HOST = 1, 2  # a block's tiers, as bits
TIER_BITS: dict[str, int] = {"device": DEVICE, "host": HOST}
# One op of a batch: (kind, keys) is a device op; (kind, keys, tier) names the tier.
Op = tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], str]


def block_key(block_hash: bytes) -> int:
    """The index key of an engine block hash."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass
class _Replica:
    deployment: str
    epoch: str = ""
    seq: int = -1  # last sequence number applied; -1: nothing trusted yet
    block_size: int = 0
    blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)  # key -> its tiers' bits
    host_blocks: int = 0  # of those, in the host tier (0: the device-only fast path)

    def clear(self) -> None:
        self.blocks.clear()
        self.host_blocks = 0

    def drop_oldest(self) -> None:
        if self.blocks.popitem(last=False)[1] & HOST:
            self.host_blocks -= 1


@dataclass(frozen=True)
class KvUpdate:
    """One batch of a replica's events, in the order the engine made them."""

    cluster: str
    replica_id: str
    deployment: str
    epoch: str  # changes when the replica (or its relay) restarts
    seq: int  # consecutive within an epoch
    ops: tuple[Op, ...] = ()  # ("stored"|"removed"|"cleared", keys[, tier]), in order
    snapshot: bool = False  # the ops give the replica's full set: replace, then trust
    block_size: int = 0


class PrefixIndex:
    """(cluster, replica) -> the block keys it holds. Bounded per replica, per cluster (its
    replicas and their blocks together) and in clusters and replicas overall, so one
    cluster publishing without end evicts only its own entries: a new replica past its
    cluster's bound drops that cluster's least recently updated one, blocks past the
    cluster's bound drop the storing replica's oldest, and only a cluster past
    `max_clusters` drops another cluster (the least recently updated)."""

    def __init__(
        self,
        max_blocks_per_replica: int = 65536,
        max_replicas: int = 4096,
        *,
        max_replicas_per_cluster: int | None = None,
        max_blocks_per_cluster: int | None = None,
        max_clusters: int = 1024,
    ) -> None:
        self.max_blocks = max_blocks_per_replica
        self.max_replicas = max_replicas
        self.max_cluster_replicas = max_replicas_per_cluster or max_replicas
        self.max_cluster_blocks = max_blocks_per_cluster or max_blocks_per_replica * self.max_cluster_replicas
        self.max_clusters = max_clusters
        if min(self.max_blocks, self.max_replicas, self.max_cluster_replicas, self.max_cluster_blocks) < 1:
            raise ValueError("index bounds must be positive")
        if max_clusters < 1:
            raise ValueError("index bounds must be positive")
        self._replicas: OrderedDict[tuple[str, str], _Replica] = OrderedDict()
        # cluster -> its replicas, least recently updated first; clusters likewise
        self._clusters: OrderedDict[str, OrderedDict[str, _Replica]] = OrderedDict()

    # ------------------------------------------------------------------ reads

    def match(self, cluster: str, replica_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the replica holds, in either tier."""
        device, host = self.match_tiers(cluster, replica_id, hashes)
        return device + host

    def match_tiers(self, cluster: str, replica_id: str, hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks of `hashes` the replica holds on its device, then how many after
        those its host tier holds: the engine's lookup, which continues in the host tier
        where the device's prefix ends."""
        r = self._replicas.get((cluster, replica_id))
        if r is None:
            return 0, 0
        blocks = r.blocks
        n = 0
        if not r.host_blocks:  # every block is on the device
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            return n, 0
        get, end = blocks.get, len(hashes)
        while n < end and get(hashes[n], 0) & DEVICE:
            n += 1
        device = n
        while n < end and get(hashes[n], 0) & HOST:
            n += 1
        return device, n - device

    def replicas(self, cluster: str, deployment: str) -> tuple[str, ...]:
        return tuple(rid for rid, r in self._clusters.get(cluster, {}).items() if r.deployment == deployment)

    def block_size(self, deployment: str) -> int | None:
        for r in self._replicas.values():
            if r.deployment == deployment and r.block_size:
                return r.block_size
        return None

    def holds(self, cluster: str, replica_id: str, key: int, tier: Tier | None = None) -> bool:
        """The replica holds the block (in `tier`; None: in any)."""
        r = self._replicas.get((cluster, replica_id))
        if r is None:
            return False
        bits = r.blocks.get(key, 0)
        return bool(bits if tier is None else bits & TIER_BITS[tier])

    def tier_blocks(self, cluster: str, replica_id: str) -> dict[Tier, int]:
        """Blocks the replica holds in each tier (a block in both counts in both)."""
        r = self._replicas.get((cluster, replica_id))
        if r is None:
            return {"device": 0, "host": 0}
        return {"device": sum(1 for b in r.blocks.values() if b & DEVICE), "host": r.host_blocks}

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
            r.clear()
            r.epoch, r.seq = update.epoch, update.seq
            r.block_size = update.block_size or r.block_size
            self._run(r, update.ops, update.cluster)
            return "applied"
        if r is None or r.seq < 0 or r.epoch != update.epoch or update.seq > r.seq + 1:
            r = self._entry(key, update.deployment)
            r.clear()
            r.epoch, r.seq = update.epoch, -1
            return "resync"
        if update.seq <= r.seq:
            return "stale"
        self._entry(key, update.deployment)
        r.seq = update.seq
        r.block_size = update.block_size or r.block_size
        self._run(r, update.ops, update.cluster)
        return "applied"

    def forget(self, cluster: str, replica_id: str) -> None:
        self._drop((cluster, replica_id))

    def keep_only(self, cluster: str, replica_ids: Iterable[str]) -> None:
        """Drop a cluster's replicas that are gone (the caller knows which still run)."""
        keep = set(replica_ids)
        for rid in [rid for rid in self._clusters.get(cluster, {}) if rid not in keep]:
            self._drop((cluster, rid))

    def cluster_blocks(self, cluster: str) -> int:
        return sum(len(r.blocks) for r in self._clusters.get(cluster, {}).values())

    def _drop(self, key: tuple[str, str]) -> None:
        self._replicas.pop(key, None)
        members = self._clusters.get(key[0])
        if members is not None:
            members.pop(key[1], None)
            if not members:
                del self._clusters[key[0]]

    def _run(self, r: _Replica, ops: Iterable[Op], cluster: str) -> None:
        blocks = r.blocks
        for kind, keys, *tier in ops:
            bit = TIER_BITS[tier[0]] if tier else DEVICE
            if kind == "cleared":
                r.clear()
            elif kind == "stored":
                self._store(r, keys, bit)
            else:
                for k in keys:
                    bits = blocks.get(k, 0)
                    if bits & bit & HOST:
                        r.host_blocks -= 1
                    if bits & ~bit:
                        blocks[k] = bits & ~bit
                    else:
                        blocks.pop(k, None)
        excess = self.cluster_blocks(cluster) - self.max_cluster_blocks
        for _ in range(min(max(0, excess), len(r.blocks))):  # the storing replica pays
            r.drop_oldest()

    def _entry(self, key: tuple[str, str], deployment: str) -> _Replica:
        cluster, rid = key
        r = self._replicas.get(key)
        if r is None:
            members = self._clusters.get(cluster)
            if members is None:
                members = self._clusters[cluster] = OrderedDict()
                while len(self._clusters) > self.max_clusters:
                    gone, old = self._clusters.popitem(last=False)
                    for old_rid in old:
                        self._replicas.pop((gone, old_rid), None)
            while len(members) >= self.max_cluster_replicas:
                self._drop((cluster, next(iter(members))))
            while len(self._replicas) >= self.max_replicas:
                self._drop(next(iter(self._replicas)))
            members = self._clusters.setdefault(cluster, OrderedDict())
            r = self._replicas[key] = members[rid] = _Replica(deployment)
        r.deployment = deployment
        self._replicas.move_to_end(key)
        self._clusters[cluster].move_to_end(rid)
        self._clusters.move_to_end(cluster)
        return r

    def _store(self, r: _Replica, keys: Iterable[int], bit: int = DEVICE) -> None:
        blocks = r.blocks
        for k in keys:
            bits = blocks.get(k, 0)
            if bit & HOST and not bits & HOST:
                r.host_blocks += 1
            blocks[k] = bits | bit
            blocks.move_to_end(k)
        while len(blocks) > self.max_blocks:
            r.drop_oldest()
