"""Tenant isolation in the replicas' prefix cache.

Every request a gateway sends a replica carries `cache_salt` derived from the API key, and
a client's own `cache_salt` is replaced: cached KV blocks are then shared only between
requests of the same key, so `usage.prompt_tokens_details.cached_tokens` (and latency)
can no longer tell one tenant whether another sent a given prompt. The salt is a hash,
not the key id, so replica logs do not name keys either.

Only an engine with the `cache_salt` capability (fleet_base.engines) mixes the field into its
cache; a request to any other gets no `cache_salt` at all (the client's is dropped too), and
the gateway's prefix keys for it are unsalted, as the engine's own events are
(agent.gateway.prefix). What such an engine gives up is said at deploy
(`fleet_base.engines.tenant_notes`) and in docs/security.md.
"""

from __future__ import annotations

import hashlib
import json

from agent.gateway.inputs import RequestInfo, upstream_body

SALT_FIELD = "cache_salt"


def cache_salt(key_id: str) -> str:
    return hashlib.sha256(f"fleet-prefix-cache:{key_id}".encode()).hexdigest()[:32]


def salt_of(key_id: str, salted: bool) -> str | None:
    """The salt of this key's prefix-cache blocks: None where the engine takes none."""
    return cache_salt(key_id) if salted else None


def salted_body(info: RequestInfo, raw: bytes, key_id: str, salted: bool = True) -> bytes:
    """`upstream_body` with this key's cache salt in place of any the client sent; without
    `salted` (an engine that ignores the field), with no salt at all."""
    out = upstream_body(info, raw)
    if not salted and SALT_FIELD not in info.body:
        return out
    body = dict(info.body) if out is raw else json.loads(out)
    body.pop(SALT_FIELD, None)
    if salted:
        body[SALT_FIELD] = cache_salt(key_id)
    return json.dumps(body, ensure_ascii=False).encode()


def body_for(info: RequestInfo, key_id: str, is_peer: bool, salted: bool = True) -> bytes:
    """The body an attempt sends: the client's to a peer (whose gateway salts it itself),
    salted (where the engine takes a salt) with the usage chunk asked for to a replica."""
    return info.raw if is_peer else salted_body(info, info.raw, key_id, salted)
