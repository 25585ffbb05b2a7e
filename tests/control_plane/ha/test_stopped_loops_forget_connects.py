"""A stopped loop (or elector) is no longer called on NATS (re)connects: leadership comes and
goes, and each term's loops must not pile up on the link."""

from __future__ import annotations

from control_plane.context import ControlPlaneContext
from control_plane.ha.elector import Elector
from control_plane.nats_loop import NatsLoop
from control_plane.settings import Settings
from fleet_base.nats_io import NatsLink


async def test_stopped_loops_and_electors_unregister_their_connect_callbacks(sessions):
    link = NatsLink("nats://127.0.0.1:1", "test")  # never started: nothing connects
    settings = Settings(leader_lease_s=1.5, leader_renew_deadline_s=1.0, leader_retry_s=0.15)
    ctx = ControlPlaneContext(settings=settings, sessions=sessions, nats=link)
    for _term in range(3):
        loop = NatsLoop(ctx)
        await loop._listen()
        assert len(link._on_connect) == 1
        await loop._close()
        assert link._on_connect == []

    async def no_loops(_ctx: ControlPlaneContext) -> None:
        return None

    elector = Elector(ctx, no_loops, member_id="a")
    await elector.start()
    await elector.stop()
    assert link._on_connect == []
