"""The batch store's backlog as autoscaler demand: sent beside the requests waiting here (its
own field: the control plane counts the shared queue once), at once when it appears with no
replica ready (scale from zero)."""

from __future__ import annotations

import asyncio

from agent.gateway.demand import DemandSignal
from fleet_base.protocol import Demand


def signal(ready: int) -> tuple[DemandSignal, list[Demand]]:
    sent: list[Demand] = []
    d = DemandSignal(None, "east", ready=lambda dep: ready, every_s=0.01)
    d._send = sent.append  # type: ignore[method-assign]
    return d, sent


def test_a_backlog_at_zero_replicas_asks_to_scale_from_zero_at_once() -> None:
    d, sent = signal(ready=0)
    d.backlog("chat", 7)
    assert [(m.deployment, m.queued, m.batch_backlog, m.ready) for m in sent] == [("chat", 0, 7, 0)]
    d.backlog("chat", 9)  # still there: the periodic report carries it
    assert len(sent) == 1


async def test_the_backlog_goes_beside_waiting_requests_and_goes_when_drained() -> None:
    d, sent = signal(ready=2)
    d.backlog("chat", 5)
    with d.waiting("chat", ready=2):
        task = asyncio.create_task(d.repeat())
        await asyncio.sleep(0.05)
        task.cancel()
    assert (sent[0].queued, sent[0].batch_backlog) == (0, 5)
    assert (sent[-1].queued, sent[-1].batch_backlog) == (1, 5)  # then with the waiting one
    d.backlog("chat", 0)
    assert d.message("chat", 2).batch_backlog == 0 and "chat" not in d.backlogs
