"""The gateway tells replicas the class it admitted each request in, and never passes a
client's own copy of that header."""

from __future__ import annotations

from pathlib import Path

from fleet_base.openai_contract.priority import PRIORITY_CLASS_HEADER
from tests.agent.gateway.batch_fleet import Fleet, chat
from tests.agent.gateway.harness import make_key


def _keyed(klass: str | None):
    secret, record = make_key(f"k{klass or 'none'}")
    return secret, record.model_copy(
        update={"quotas": record.quotas.model_copy(update={"priority_class": klass})}
    )


async def test_the_replica_gets_the_keys_class_whatever_the_client_sent(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, {"inter": _keyed("interactive"), "plain": _keyed(None)})
    r = await fleet.post("inter", chat(), {PRIORITY_CLASS_HEADER: "interactive-plus"})
    assert r.status_code == 200, r.text
    r = await fleet.post("plain", chat(), {PRIORITY_CLASS_HEADER: "interactive"})  # a client's wish
    assert r.status_code == 200
    sent = [s.headers.get_list(PRIORITY_CLASS_HEADER) for s in fleet.replicas.sent]
    assert sent == [["interactive"], ["standard"]]  # the key's; the gateway's default class
