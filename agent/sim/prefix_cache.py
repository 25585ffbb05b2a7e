"""A simulated replica's prefix cache: LRU over chained block ids, as the engine's block
pool evicts the least recently freed cached block first.

Capacity is the profile's KV capacity in blocks. Simplification: blocks of running
requests are not pinned (the engine never evicts a referenced block), so under heavy
load this cache forgets a little sooner than a real one. Changes go to a listener as
KV-event ops, which is how the simulator feeds the same prefix index the gateway uses.

With a host tier (`host_blocks`), a block evicted from the device is offloaded there
instead of dropped (LRU within the tier too); a lookup continues in the host tier where
the device's prefix ends, and the host blocks it finds are loaded back on insert (the host copy stays, now
most recently used). Host changes go to their own listener (`on_host_change`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

Ops = list[tuple[str, tuple[int, ...]]]


def capacity_blocks(kv_capacity_tokens: int, block_tokens: int) -> int:
    """Blocks of `block_tokens` a replica's KV capacity holds (0: no blocks, no cache)."""
    return kv_capacity_tokens // block_tokens if block_tokens > 0 else 0


class PrefixCacheModel:
    def __init__(
        self,
        capacity_blocks: int,
        on_change: Callable[[Ops], None] | None = None,
        host_blocks: int = 0,
        on_host_change: Callable[[Ops], None] | None = None,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("a prefix cache holds at least one block")
        self.capacity = capacity_blocks
        self.host_capacity = max(0, host_blocks)
        self.on_change = on_change
        self.on_host_change = on_host_change
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._host: OrderedDict[int, None] = OrderedDict()
        self.queried_blocks = 0
        self.hit_blocks = 0
        self.host_hit_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def in_host(self, block: int) -> bool:
        return block in self._host

    @property
    def host_len(self) -> int:
        return len(self._host)

    def lookup(self, blocks: Sequence[int]) -> int:
        """Leading blocks held in either tier (a chained id needs every earlier one)."""
        device, host = self.lookup_tiers(blocks)
        return device + host

    def lookup_tiers(self, blocks: Sequence[int]) -> tuple[int, int]:
        """Leading blocks held: (on the device, then after those in the host tier), as
        the engine's lookup continues in the host tier where the device's prefix ends.
        Counted in the hit statistics (an admission's lookup)."""
        device, host = self.peek_tiers(blocks)
        self.queried_blocks += len(blocks)
        self.hit_blocks += device + host
        self.host_hit_blocks += host
        return device, host

    def peek_tiers(self, blocks: Sequence[int]) -> tuple[int, int]:
        """`lookup_tiers` without counting it (a scheduler looking before it admits)."""
        device = host = 0
        for b in blocks:
            if host == 0 and b in self._blocks:
                device += 1
            elif b in self._host:
                host += 1
            else:
                break
        return device, host

    def insert(self, blocks: Sequence[int]) -> None:
        """The request's blocks are computed (or reused): most recently used now, its first
        block most of all, as the engine frees a request's blocks tail first: a prefix's
        tail is evicted before its head, never the head under a surviving tail."""
        added: list[int] = []
        for b in reversed(blocks):
            if b in self._blocks:
                self._blocks.move_to_end(b)
            else:
                self._blocks[b] = None
                added.append(b)
            if b in self._host:  # loaded back: the host copy is used again
                self._host.move_to_end(b)
        evicted: list[int] = []
        while len(self._blocks) > self.capacity:
            b, _ = self._blocks.popitem(last=False)
            evicted.append(b)
        if self.on_change is not None and (added or evicted):
            gone = set(evicted)
            self.on_change(
                [("removed", tuple(evicted)), ("stored", tuple(b for b in added if b not in gone))]
            )
        if self.host_capacity and evicted:
            self._offload(evicted)

    def _offload(self, evicted: Sequence[int]) -> None:
        """Device evictions move to the host tier; its least recently used go."""
        stored: list[int] = []
        for b in evicted:
            if b in self._host:
                self._host.move_to_end(b)
            else:
                self._host[b] = None
                stored.append(b)
        dropped: list[int] = []
        while len(self._host) > self.host_capacity:
            b, _ = self._host.popitem(last=False)
            dropped.append(b)
        if self.on_host_change is not None:
            gone = set(dropped)
            self.on_host_change(
                [("removed", tuple(dropped)), ("stored", tuple(b for b in stored if b not in gone))]
            )
