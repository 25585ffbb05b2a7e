"""A foreign engine's KV-cache events re-keyed into Fleet's block hashes.

vLLM and SGLang name a cached block by their own hash (Python's `hash`, or sha256 over a
pickle, seeded per process), which never equals the key Fleet's router computes from a
prompt (`fleet_base.block_hash`). Their `BlockStored` events carry the blocks' token ids and
the parent's engine hash, so each block's Fleet hash is `hash_block(parent's Fleet hash,
its token ids)`, the same function the gateway and Fleet's engine use, with the chain's
first parent the root of the request's cache salt (vLLM reports it in the first block's
`extra_keys`; without one the root is the unsalted one). A map from engine hash to Fleet
hash (bounded, least recently stored dropped first) then turns `BlockRemoved` into Fleet
removals.

Safety over recall, like the gateway's index: a block whose parent is unknown cannot be
placed in a chain and is dropped; a removal of an unknown block is dropped (nothing was
published for it); a block forgotten for the bound is published as removed, so no reader
keeps a block this map can no longer evict. After a lost stretch of events (`forget_held`)
nothing is claimed held until stored again, while the translations are kept (an engine
hash names the same content for the engine's life), so children of blocks cached before
the gap can still be placed. Pure and synchronous.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleet_base.block_hash import hash_block, root_hash
from fleet_base.engine_kv_events import AllCleared, EngineEvent, RemovedBlocks, StoredBlocks
from fleet_base.kv_events import TIERS, Tier

MAX_BLOCKS = 1 << 18  # translations kept per replica (~100 bytes each)
TIER_BITS: dict[Tier, int] = {"device": 1, "host": 2}

# One Fleet op: (kind, Fleet hashes as hex, tier), what agent.kv_relay publishes.
Op = tuple[str, list[str], Tier]


@dataclass
class _Block:
    fleet: bytes
    tiers: int = 0  # TIER_BITS of the tiers the engine holds it in


@dataclass
class Translated:
    """Fleet ops for a batch of engine events, and what happened to the events' blocks
    (`outcomes`: stored, removed, cleared, unknown_parent, unknown_block, block_size,
    malformed, group, evicted)."""

    ops: list[Op] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, hashes: list[str], tier: Tier) -> None:
        if self.ops and self.ops[-1][0] == kind and self.ops[-1][2] == tier and kind != "cleared":
            self.ops[-1][1].extend(hashes)
        else:
            self.ops.append((kind, hashes, tier))


class FleetHashTranslator:
    """One replica's engine-hash -> Fleet-hash map. `block_size` is fixed by the first
    stored event (0 until then); a later event of another size is dropped."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.block_size = 0
        self._blocks: OrderedDict[str, _Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def fleet_hash(self, engine_hash: str) -> bytes | None:
        b = self._blocks.get(engine_hash)
        return None if b is None else b.fleet

    def apply(self, events: Iterable[EngineEvent]) -> Translated:
        out = Translated()
        for event in events:
            if isinstance(event, StoredBlocks):
                self._stored(event, out)
            elif isinstance(event, RemovedBlocks):
                self._removed(event, out)
            elif isinstance(event, AllCleared):
                self._blocks.clear()
                out.add("cleared", [], "device")
                out.outcomes["cleared"] += 1
        return out

    def held(self) -> list[Op]:
        """Every block the engine holds as far as this map knows: a snapshot's ops."""
        out = Translated()
        for tier in TIERS:
            bit = TIER_BITS[tier]
            hashes = [b.fleet.hex() for b in self._blocks.values() if b.tiers & bit]
            if hashes:
                out.add("stored", hashes, tier)
        return out.ops

    def forget_held(self) -> None:
        """Events were lost: claim nothing until it is stored again (translations stay)."""
        for b in self._blocks.values():
            b.tiers = 0

    def clear(self) -> None:
        """The engine restarted: its hashes (seeded per process) mean nothing any more."""
        self._blocks.clear()
        self.block_size = 0

    # ------------------------------------------------------------------ events

    def _stored(self, e: StoredBlocks, out: Translated) -> None:
        n = len(e.block_hashes)
        if e.group not in (None, 0):  # a hybrid model's other KV group (e.g. sliding window)
            out.outcomes["group"] += n
            return
        if self.block_size and e.block_size != self.block_size:
            out.outcomes["block_size"] += n
            return
        if len(e.token_ids) != n * e.block_size:
            out.outcomes["malformed"] += n
            return
        if e.parent is None:
            parent = root_hash(e.salt)
        else:
            known = self._blocks.get(e.parent)
            if known is None:
                out.outcomes["unknown_parent"] += n
                return
            parent = known.fleet
        self.block_size = e.block_size
        bit, size, tokens = TIER_BITS[e.tier], e.block_size, e.token_ids
        stored: list[str] = []
        for i, engine_hash in enumerate(e.block_hashes):
            try:
                parent = hash_block(parent, tokens[i * size : (i + 1) * size])
            except (TypeError, OverflowError):  # a token id that is no int64
                out.outcomes["malformed"] += n - i
                break
            block = self._blocks.get(engine_hash)
            if block is not None and block.fleet != parent:  # the engine reused a hash
                self._release(block, out)
                block = None
            if block is None:
                block = self._blocks[engine_hash] = _Block(parent)
            self._blocks.move_to_end(engine_hash)
            block.tiers |= bit
            stored.append(parent.hex())
        out.outcomes["stored"] += len(stored)
        if stored:
            out.add("stored", stored, e.tier)
        self._bound(out)

    def _removed(self, e: RemovedBlocks, out: Translated) -> None:
        if e.group not in (None, 0):
            out.outcomes["group"] += len(e.block_hashes)
            return
        bit = TIER_BITS[e.tier]
        removed: list[str] = []
        for engine_hash in e.block_hashes:
            block = self._blocks.get(engine_hash)
            if block is None or not block.tiers & bit:
                out.outcomes["unknown_block"] += 1
                continue
            block.tiers &= ~bit
            removed.append(block.fleet.hex())
        out.outcomes["removed"] += len(removed)
        if removed:
            out.add("removed", removed, e.tier)

    def _bound(self, out: Translated) -> None:
        while len(self._blocks) > self.max_blocks:
            _, block = self._blocks.popitem(last=False)
            out.outcomes["evicted"] += 1
            self._release(block, out)

    @staticmethod
    def _release(block: _Block, out: Translated) -> None:
        """Publish the removal of a block this map stops tracking."""
        for tier in TIERS:
            if block.tiers & TIER_BITS[tier]:
                out.add("removed", [block.fleet.hex()], tier)
        block.tiers = 0
