"""The physical KV blocks: reference counts, an LRU free queue, and the hash -> block cache.

A block with ref count 0 sits in the free queue but keeps its cached hash, so a later
request with the same prefix can take it back (prefix caching). Blocks leave the queue
from the head; freed blocks join at the tail, so the head is the least recently freed
block and eviction is LRU. Every operation is O(blocks touched): the queue is an
intrusive doubly linked list, so a cache hit on a free block unlinks it in O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from engine.kv_cache.events import KvEventLog
from fleet_base.block_hash import BlockHash


class KVBlock:
    """One block's bookkeeping. `prev`/`next` link it into the free queue while ref_cnt == 0."""

    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._len += 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("free block queue is empty")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1


class BlockPool:
    """Owns blocks 0..num_blocks-1; hands them out, takes them back, remembers their hashes."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KvEventLog | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # Never-used blocks first, in id order; freed blocks follow in the order freed.
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.events = events  # told of every hash cached and evicted (KV events)
        # Told of each cached block taken for reuse while its KV is still intact (before the
        # new owner's step writes it): the host tier copies it out instead of dropping it.
        self.on_evict: Callable[[KVBlock, BlockHash], None] | None = None

    # ---- queries -------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def cached_items(self) -> list[tuple[BlockHash, int]]:
        """(hash, block id) of every cached block; for invariant checks and debugging."""
        return [(h, b.block_id) for h, b in self._cached.items()]

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (head first); O(num free), for tests and debugging."""
        return [b.block_id for b in self.free_queue]

    # ---- mutations -----------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue (evicting their cached hashes), ref 1 each."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        out: list[KVBlock] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if self.on_evict is not None and block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    self.on_evict(block, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to cache-hit blocks, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (= the order they become evictable)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full block under its hash; False (and left uncached) if the hash is taken."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash)
        return True

    def uncache(self, block: KVBlock) -> None:
        """Forget `block`'s hash (its KV is not what the hash says); it stays allocated."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        block.block_hash = None
