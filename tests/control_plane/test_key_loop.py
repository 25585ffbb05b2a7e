"""fleet_keys is published by its own loop: keys reach NATS while placement fails, with
the key set's lease renewed on every pass, and a revoked key is deleted at once."""

from __future__ import annotations

import pytest

from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.loops import Loops
from control_plane.loops.keys import KeyLoop
from control_plane.loops.publish import bucket_items
from control_plane.settings import Settings
from fleet_base import api_keys, protocol
from tests.control_plane.test_loops_publish import connected, nats_server  # noqa: F401 (fixture)
from tests.polling import eventually


class BrokenPlacer:
    name = "broken"

    def solve(self, *args, **kwargs):
        # a ValueError (bad input) is what the placement pipeline lets through; any other
        # placer error falls back to FFD
        raise ValueError("placement input is broken")


async def test_keys_and_their_lease_publish_while_placement_fails(nats_server, sessions, tmp_path):  # noqa: F811
    link = await connected(nats_server.url)
    settings = Settings(home=tmp_path, key_lease_interval_s=0.2)
    ctx = ControlPlaneContext(settings=settings, sessions=sessions, nats=link)
    with sessions() as s:
        s.add(m.ApiKey(key_id="k1", name="app", salt="s", hash="h", scopes=["inference"]))
        s.commit()
    loops = Loops(ctx)
    loops.placer = BrokenPlacer()
    with pytest.raises(ValueError):
        await loops.reconcile_now()  # placement fails ...
    keys = await KeyLoop(ctx).start()  # ... and keys are published anyway
    try:

        async def published() -> dict[str, bytes] | None:
            items, _ = await bucket_items(link, protocol.BUCKET_KEYS)
            return items if "k1" in items and api_keys.KEYS_LEASE in items else None

        def lease_of(items: dict[str, bytes]) -> api_keys.KeyLease:
            return api_keys.KeyLease.from_bytes(items[api_keys.KEYS_LEASE])

        lease = lease_of(await eventually(published, 30, "the keys published"))
        assert lease.keys == 1 and lease.valid_s > settings.key_lease_interval_s

        async def renewed() -> bool:
            items = await published()
            return items is not None and lease_of(items).issued_at > lease.issued_at

        await eventually(renewed, 30, "the lease renewed without any key changing")

        with sessions() as s:
            s.get(m.ApiKey, "k1").revoked_at = m.utcnow()
            s.commit()
        ctx.kick()

        async def revoked_gone() -> bool:
            return "k1" not in (await bucket_items(link, protocol.BUCKET_KEYS))[0]

        await eventually(revoked_gone, 30, "the revoked key deleted from fleet_keys")
    finally:
        await keys.stop()
        await link.close()
