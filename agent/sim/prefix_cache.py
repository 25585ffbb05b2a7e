"""A simulated replica's prefix cache: LRU over chained block ids, as the engine's block
pool evicts the least recently freed cached block first.

Capacity is the profile's KV capacity in blocks. Simplification: blocks of running
requests are not pinned (the engine never evicts a referenced block), so under heavy
load this cache forgets a little sooner than a real one. Changes go to a listener as
KV-event ops, which is how the simulator feeds the same prefix index the gateway uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

Ops = list[tuple[str, tuple[int, ...]]]


def capacity_blocks(kv_capacity_tokens: int, block_tokens: int) -> int:
    """Blocks of `block_tokens` a replica's KV capacity holds (0: no blocks, no cache)."""
    return kv_capacity_tokens // block_tokens if block_tokens > 0 else 0


class PrefixCacheModel:
    def __init__(self, capacity_blocks: int, on_change: Callable[[Ops], None] | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError("a prefix cache holds at least one block")
        self.capacity = capacity_blocks
        self.on_change = on_change
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queried_blocks = 0
        self.hit_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def lookup(self, blocks: Sequence[int]) -> int:
        """Leading blocks held (a chained id needs every earlier one)."""
        n = 0
        for b in blocks:
            if b not in self._blocks:
                break
            n += 1
        self.queried_blocks += len(blocks)
        self.hit_blocks += n
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """The request's blocks are computed (or reused): most recently used now."""
        added: list[int] = []
        for b in blocks:
            if b in self._blocks:
                self._blocks.move_to_end(b)
            else:
                self._blocks[b] = None
                added.append(b)
        evicted: list[int] = []
        while len(self._blocks) > self.capacity:
            b, _ = self._blocks.popitem(last=False)
            evicted.append(b)
        if self.on_change is not None and (added or evicted):
            gone = set(evicted)
            self.on_change(
                [("removed", tuple(evicted)), ("stored", tuple(b for b in added if b not in gone))]
            )
