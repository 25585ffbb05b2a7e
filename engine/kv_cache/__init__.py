"""Paged KV cache bookkeeping: block pool, prefix cache, per-request block tables (no torch)."""

from engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv_cache.events import KvEventLog, KvEventsRead
from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.kv_cache_manager import (
    KVCacheManager,
    KvTransfer,
    PrefixCacheStats,
    PrefixHit,
    TierStats,
)
from fleet_base.block_hash import BlockHash, hash_block, hash_request_blocks, root_hash

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "HostTier",
    "KVBlock",
    "KVCacheManager",
    "KvEventLog",
    "KvEventsRead",
    "KvTransfer",
    "PrefixCacheStats",
    "PrefixHit",
    "TierStats",
    "hash_block",
    "hash_request_blocks",
    "root_hash",
]
