"""Chained content hashes that name a full KV block by everything before and in it.

A block's KV depends on every earlier token, so its key is
``sha256(parent_hash || token ids)``; the first block's parent is a root derived from the
request's ``cache_salt``, which is how equal tokens under another salt never match.
sha256 (not Python's ``hash``) keeps keys stable across processes and collision-resistant;
the parent is always 32 bytes and every block holds ``block_size`` tokens, so the encoding
is unambiguous.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

_ROOT_PREFIX = b"fleet-kv-cache-root\x00"


def root_hash(cache_salt: str | None) -> BlockHash:
    """Parent hash of a request's first block; distinct for every salt, including None."""
    if cache_salt is None:
        return hashlib.sha256(_ROOT_PREFIX + b"\x00").digest()
    return hashlib.sha256(_ROOT_PREFIX + b"\x01" + cache_salt.encode("utf-8")).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Key of a full block given its parent's key and its own token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Keys of every full block of a token sequence (tests and tools; the manager hashes lazily)."""
    parent = root_hash(cache_salt)
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
