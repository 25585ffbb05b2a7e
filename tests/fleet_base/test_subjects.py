"""The subject table (`fleet_base.subjects`): every subject the agent's and the gateway's
code publishes, requests, subscribes or answers on is in its role's row, and the link
refuses (loudly) what is not."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from fleet_base import kv_events, protocol, subjects
from fleet_base.nats_io import NatsLink
from fleet_base.subjects import CHANNELS, covers, permits

ROOT = Path(__file__).resolve().parents[2]
OPS = {"publish": "publish", "request": "publish", "subscribe": "subscribe", "respond": "subscribe"}
WILDCARDS = {
    name: value
    for module in (protocol, kv_events)
    for name, value in vars(module).items()
    if name.endswith("_WILDCARD")
}


def _channel(name: str) -> subjects.Channel | None:
    """The channel a subject function or wildcard constant names, None for other names."""
    for channel in CHANNELS:
        if channel.subject.__name__ == name or channel.subject("*") == WILDCARDS.get(name):
            return channel
    return None


def _name(node: ast.expr, assigned: dict[str, ast.expr]) -> str | None:
    """The subject function or constant an argument is built from (following `self.x = ...`)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        if node.attr in assigned:
            return _name(assigned[node.attr], {})
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _uses(path: Path) -> list[tuple[str, str, int]]:
    """(op, subject name, line) of each NATS call in a module whose subject is a named one."""
    tree = ast.parse(path.read_text())
    assigned = {
        t.attr: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute)
    }
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        if node.func.attr not in OPS:
            continue
        name = _name(node.args[0], assigned)
        if name and (name.endswith(("_subject", "_WILDCARD"))):
            out.append((OPS[node.func.attr], name, node.lineno))
    return out


def test_every_subject_the_agent_and_gateway_use_is_in_their_row():
    found = 0
    for path in sorted((ROOT / "agent").rglob("*.py")):
        role = "gateway" if "gateway" in path.relative_to(ROOT).parts else "agent"
        for op, name, line in _uses(path):
            found += 1
            channel = _channel(name)
            where = f"{path.relative_to(ROOT)}:{line} {op} {name}"
            assert channel is not None, f"{where}: no channel in fleet_base.subjects.CHANNELS"
            assert role in getattr(channel, op), f"{where}: the {role} row of {channel.name} has no {op}"
    # heartbeat, events, usage, demand, kvcache and kvresync (twice each side), models
    assert found >= 9


def test_the_gateway_may_ask_any_cluster_for_a_resync_and_the_agent_hears_its_own():
    gateway, agent = permits("gateway", "west"), permits("agent", "east")
    assert gateway.may("publish", kv_events.kvresync_subject("east"))
    assert agent.may("subscribe", kv_events.kvresync_subject("east"))
    assert not agent.may("subscribe", kv_events.kvresync_subject("west"))
    assert not gateway.may("publish", kv_events.kvcache_subject("west"))  # the agent relays those
    assert not agent.may("publish", protocol.heartbeat_subject("west"))
    assert gateway.may("subscribe", protocol.HEARTBEAT_WILDCARD)
    assert agent.may("subscribe", "$KV.fleet_desired.east") and not agent.may(
        "subscribe", "$KV.fleet_desired.>"
    )


@pytest.mark.parametrize(
    ("allow", "subject", "ok"),
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.*", True),
        ("a.b", "a.*", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.*", "a.>", False),
        ("a.*", "a.b.c", False),
        ("a.b.c", "a.b", False),
    ],
)
def test_covers_follows_nats_wildcards(allow, subject, ok):
    assert covers(allow, subject) is ok


async def test_a_link_refuses_and_counts_what_its_row_does_not_allow(caplog):
    link = NatsLink("nats://127.0.0.1:1", "gateway", permits=permits("gateway", "west"))
    with caplog.at_level(logging.WARNING, logger="fleet_base.nats_io"):
        assert not link.allows("publish", protocol.heartbeat_subject("west"))
        assert link.allows("publish", kv_events.kvresync_subject("east"))
    assert link.refused == {"publish": 1}
    assert "refused" in caplog.text
