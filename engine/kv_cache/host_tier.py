"""The host-memory tier below the device KV pool: which prefix blocks it holds, in which
of its slots, in LRU order (bookkeeping only; the bytes live with the runner).

A full prefix block the device pool evicts is offered here instead of being dropped; a
prefix lookup that ends on the device continues here, and a hit is copied back into a new
device block rather than recomputed. A slot being read by a pending load is pinned: it is
neither evicted nor overwritten until the load is done (`unpin`).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kv_cache.events import KvEventLog
from fleet_base.block_hash import BlockHash


class HostTier:
    def __init__(self, capacity_bytes: int, block_bytes: int, events: KvEventLog | None = None) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.num_slots = max(0, capacity_bytes // block_bytes)
        self.events = events
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pins: dict[int, int] = {}  # slot -> pending loads reading it

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding `block_hash`, or None; changes nothing."""
        return self._slots.get(block_hash)

    def hashes(self) -> list[BlockHash]:
        """Held hashes, least recently used first."""
        return list(self._slots)

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot to copy the evicted device block `block_hash` into, evicting the least
        recently used unpinned entry if full; None when no copy is needed (already held,
        now most recently used) or possible (no slots, or every one pinned)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._slots[block_hash] = slot
        if self.events is not None:
            self.events.stored(block_hash, tier="host")
        return slot

    def pin(self, block_hash: BlockHash) -> int:
        """Hold `block_hash`'s slot for a load (most recently used now); KeyError if absent."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._pins[slot] = self._pins.get(slot, 0) + 1
        return slot

    def unpin(self, slot: int) -> None:
        n = self._pins.get(slot, 0)
        if n <= 0:
            raise ValueError(f"host slot {slot} is not pinned")
        if n == 1:
            del self._pins[slot]
        else:
            self._pins[slot] = n - 1

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pins

    def clear(self) -> bool:
        """Forget every entry; refused (False) while a load is pending."""
        if self._pins:
            return False
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        return True

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim, slot in self._slots.items():  # oldest first; pinned slots are skipped
            if slot not in self._pins:
                del self._slots[victim]
                if self.events is not None:
                    self.events.removed(victim, tier="host")
                return slot
        return None
