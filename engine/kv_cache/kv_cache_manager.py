"""Per-request block tables over a `BlockPool`, with prefix caching by chained block hashes.

The scheduler asks `get_computed_blocks` what prefix of a waiting request is already in
the cache, then `allocate_slots` for the tokens it wants computed this step, and `free`
when the request finishes, is aborted or is preempted. Full blocks are registered in the
cache at allocation time: they are written in the same forward pass that any later hit
in that step would read from, and every layer writes KV before it attends.

With a host tier (`HostTier`), a cached block the pool takes for reuse is offered to the
tier, and a lookup that ends on the device continues there: host hits get new device
blocks and count as computed tokens. The KV bytes move as `KvTransfer`s, in order, which
the runner performs before the step that could overwrite or read them
(`take_transfers`, then `transfers_done`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Literal

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.events import KvEventLog, Tier
from engine.kv_cache.host_tier import HostTier
from engine.request import Request
from fleet_base.block_hash import BlockHash, hash_block, root_hash


@dataclass
class PrefixCacheStats:
    """Cumulative token counts: tokens looked up, and tokens served from the cache."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def record(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class PrefixHit:
    """A waiting request's cached prefix: device blocks, then host-tier blocks to load."""

    block_ids: list[int] = field(default_factory=list)
    host_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class KvTransfer:
    """One block copy: "offload" device block -> host slot, "load" host slot -> device block."""

    kind: Literal["offload", "load"]
    block_id: int
    slot: int


@dataclass
class TierStats:
    """Cumulative: blocks hit per tier at admission, bytes moved between the tiers."""

    hits: dict[Tier, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"offload": 0, "load": 0})


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KvEventLog | None = None,
        host_tier: HostTier | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self.stats = PrefixCacheStats()
        # request_id -> its blocks, in position order.
        self._tables: dict[str, list[KVBlock]] = {}
        # request_id -> how many leading blocks of its table were already offered to the cache.
        self._num_hashed_blocks: dict[str, int] = {}
        # Block hashes of each request's full blocks, computed lazily and kept as long as the
        # Request object lives (so preemption and re-admission do not rehash the prompt).
        self._hashes: weakref.WeakKeyDictionary[Request, list[BlockHash]] = weakref.WeakKeyDictionary()
        self.host = host_tier if enable_caching else None
        self.tier_stats = TierStats()
        self._transfers: list[KvTransfer] = []
        if self.host is not None:
            self.block_pool.on_evict = self._offload

    # ---- stats passthrough ---------------------------------------------------------------

    @property
    def prefix_cache_queries(self) -> int:
        return self.stats.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.stats.prefix_cache_hits

    # ---- queries -------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks()

    @property
    def usage(self) -> float:
        return 1.0 - self.block_pool.num_free_blocks() / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for an unknown request)."""
        return [b.block_id for b in self._tables.get(request_id, ())]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[int], int]:
        """Longest cached run of full prefix blocks; never the block holding the last token.

        A scheduler that may look up the same waiting request on several steps passes
        record_stats=False and records once on admission (`stats.record`)."""
        if not self.enable_caching:
            return [], 0
        # At most num_tokens - 1 tokens may be reused, so the model computes the last one.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block = self.block_pool.get_cached_block(self._block_hash(request, i))
            if block is None:
                break
            hit.append(block.block_id)
        num_computed = len(hit) * self.block_size
        if record_stats:
            self.stats.record(request.num_tokens, num_computed)
        return hit, num_computed

    def find_prefix(self, request: Request, record_stats: bool = True) -> PrefixHit:
        """`get_computed_blocks`, continued in the host tier where the device run ends."""
        block_ids, num_computed = self.get_computed_blocks(request, record_stats=False)
        hit = PrefixHit(block_ids, [], num_computed)
        if self.host is not None:
            for i in range(len(block_ids), (request.num_tokens - 1) // self.block_size):
                block_hash = self._block_hash(request, i)
                if block_hash not in self.host:
                    break
                hit.host_hashes.append(block_hash)
            hit.num_computed_tokens += len(hit.host_hashes) * self.block_size
        if record_stats:
            self.stats.record(request.num_tokens, hit.num_computed_tokens)
        return hit

    # ---- mutations -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        host_hits: list[BlockHash] | None = None,
    ) -> bool:
        """Give the request blocks for its computed + cached + new tokens; False changes nothing.

        `host_hits` (from `find_prefix`) follow the device hits: each gets a new device block
        and a pending load from the host tier."""
        bs = self.block_size
        pool = self.block_pool
        table = self._tables.get(request.request_id)
        hits = [pool.blocks[i] for i in new_computed_blocks] if new_computed_blocks else []
        host_hits = host_hits or []
        if hits or host_hits:
            if table:
                raise ValueError(f"request {request.request_id}: cache hits given to a request with blocks")
            if any(b.block_hash is None for b in hits):
                raise ValueError(f"request {request.request_id}: a cache-hit block was evicted meanwhile")
            if host_hits and (self.host is None or any(h not in self.host for h in host_hits)):
                raise ValueError(f"request {request.request_id}: a host-tier hit is not in the host tier")
        num_held = len(table) if table else 0
        total_tokens = request.num_computed_tokens + (len(hits) + len(host_hits)) * bs + num_new_tokens
        num_needed = max(0, -(-total_tokens // bs) - num_held - len(hits))
        # Hits that sit in the free queue leave it when touched, so they are not free capacity.
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > pool.num_free_blocks() - num_hits_free:
            return False

        if table is None:
            table = self._tables[request.request_id] = []
            self._num_hashed_blocks[request.request_id] = 0
        if hits:
            pool.touch(hits)
            table.extend(hits)
            self._num_hashed_blocks[request.request_id] = len(hits)
        # Pinned before any allocation below can offload into (and so evict from) the host tier.
        slots = [self.host.pin(h) for h in host_hits] if self.host is not None else []
        if num_needed:
            new_blocks = pool.get_new_blocks(num_needed)  # may queue offloads of evicted blocks
            for block, slot in zip(new_blocks, slots):  # loads after them: the order is the copy order
                self._transfers.append(KvTransfer("load", block.block_id, slot))
            table.extend(new_blocks)
        if hits or host_hits:
            self.tier_stats.hits["device"] += len(hits)
            self.tier_stats.hits["host"] += len(host_hits)
        if self.enable_caching:
            self._cache_full_blocks(request, table, min(total_tokens, request.num_tokens) // bs)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the tail blocks past the first `num_tokens` slots (rejected speculative
        drafts). Those blocks were never full of real tokens, so none of them is cached."""
        table = self._tables.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not table or len(table) <= keep:
            return
        tail = table[keep:]
        del table[keep:]
        rid = request.request_id
        self._num_hashed_blocks[rid] = min(self._num_hashed_blocks[rid], keep)
        self.block_pool.free_blocks(reversed(tail))

    def forget_uncomputed(self, request: Request) -> None:
        """Uncache the request's blocks past its computed tokens: they were hashed when
        allocated, for a step that failed before it wrote them."""
        table = self._tables.get(request.request_id)
        first = request.num_computed_tokens // self.block_size
        if not table or len(table) <= first:
            return
        for block in table[first:]:
            self.block_pool.uncache(block)
        rid = request.request_id
        self._num_hashed_blocks[rid] = min(self._num_hashed_blocks[rid], first)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its shared prefix is evicted last."""
        table = self._tables.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes, in both tiers; refused (False) while any block is in
        use or a transfer is pending."""
        if self._transfers or len(self.block_pool.free_queue) != self.num_blocks:
            return False
        if self.host is not None:
            self.host.clear()
        return self.block_pool.reset_prefix_cache()

    def take_transfers(self) -> list[KvTransfer]:
        """The copies queued since the last call, in the order they must run; hand them to
        `transfers_done` once the runner has performed them."""
        out, self._transfers = self._transfers, []
        return out

    def transfers_done(self, transfers: list[KvTransfer]) -> None:
        """The copies ran: loaded host slots may be evicted again; bytes are counted."""
        assert self.host is not None or not transfers
        for t in transfers:
            if t.kind == "load":
                assert self.host is not None
                self.host.unpin(t.slot)
            self.tier_stats.bytes[t.kind] += self.host.block_bytes if self.host is not None else 0

    def abandon_transfers(self, transfers: list[KvTransfer]) -> None:
        """The copies failed: the blocks they were to load hold no valid KV, so they leave the
        cache; the host slots they read are released."""
        for t in transfers:
            if t.kind == "load":
                assert self.host is not None
                self.block_pool.uncache(self.block_pool.blocks[t.block_id])
                self.host.unpin(t.slot)

    # ---- internals -----------------------------------------------------------------------

    def _offload(self, block: KVBlock, block_hash: BlockHash) -> None:
        """The pool takes cached `block` for reuse: keep its KV in the host tier."""
        assert self.host is not None
        slot = self.host.store(block_hash)
        if slot is not None:
            self._transfers.append(KvTransfer("offload", block.block_id, slot))

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_full: int) -> None:
        rid = request.request_id
        start = self._num_hashed_blocks[rid]
        if num_full <= start:
            return
        for i in range(start, num_full):
            # A hash already held by another block stays with that block (no duplicates).
            self.block_pool.cache_block(table[i], self._block_hash(request, i))
        self._num_hashed_blocks[rid] = num_full

    def _block_hash(self, request: Request, index: int) -> BlockHash:
        """Hash of the request's block `index` (must be full), extending the memo as needed.

        The memo assumes token ids at existing positions never change (outputs only append).
        """
        hashes = self._hashes.get(request)
        if hashes is None:
            hashes = self._hashes[request] = []
        bs = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            tokens = request.token_ids_slice(i * bs, (i + 1) * bs)
            if len(tokens) != bs:
                raise ValueError(f"request {request.request_id}: block {i} is not full")
            parent = hashes[-1] if hashes else root_hash(request.cache_salt)
            hashes.append(hash_block(parent, tokens))
        return hashes[index]
