"""`GET /kv/events` on a real replica: the block hashes it publishes are the ones the
gateway computes from the same prompt's token ids."""

from __future__ import annotations

import httpx

from agent.gateway.kv_index import block_key
from agent.gateway.prefix import prefix_keys
from tests.engine.server.conftest import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def test_published_hashes_are_the_gateways_block_keys(http: httpx.Client) -> None:
    first = http.get("/kv/events").json()
    assert first["snapshot"] is True and first["block_size"] >= 1
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    delta = http.get("/kv/events", params={"epoch": first["epoch"], "after": first["seq"], "wait": 5}).json()
    assert delta["snapshot"] is False and delta["seq"] > first["seq"]
    assert {op["tier"] for op in delta["ops"]} == {"device"}  # no host tier on this replica
    stored = {
        block_key(bytes.fromhex(h))
        for op in delta["ops"]
        if op["kind"] == "stored"
        for h in op["block_hashes"]
    }
    ours = prefix_keys(ids, first["block_size"])
    assert len(ours) >= 4 and set(ours) <= stored | _snapshot_keys(first)
    assert http.get("/kv/events", params={"after": -1}).status_code == 400


def _snapshot_keys(read: dict) -> set[int]:
    return {block_key(bytes.fromhex(h)) for op in read["ops"] for h in op["block_hashes"]}
