"""Usage of batch lines and async requests: stored with `batch`, booked once per line
however often it ran (its record id is the line's), charged to the key as any request and
listed apart in the usage report."""

from __future__ import annotations

import json
import uuid

from control_plane.api.routers.usage import get_usage
from control_plane.db import models as m
from control_plane.db.session import make_sessions
from control_plane.loops.usage import store_records
from fleet_base.batch.names import usage_record_id
from fleet_base.protocol import UsageRecord
from tests.fleetctl import fleetctl


def _line(index: int, **kw: object) -> UsageRecord:
    fields: dict = {
        "cluster": "east",
        "key_id": "k",
        "deployment": "chat",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "batch": True,
        "record_id": usage_record_id("batch_abc", index),
    }
    return UsageRecord(**{**fields, **kw})


def test_batch_usage_is_the_keys_and_listed_apart(sessions):
    interactive = UsageRecord(cluster="east", key_id="k", deployment="chat", prompt_tokens=100)
    rerun = _line(0, cluster="west")  # line 0 ran again elsewhere after a crash
    assert store_records(sessions, [interactive, _line(0), _line(1, status=400), rerun]) == 3
    with sessions() as s:
        assert s.query(m.UsageRecord).filter_by(batch=True).count() == 2
        report = get_usage(
            session=s, who=None, key=None, deployment=None, since="1h", region=None, jurisdiction=None
        )
    assert [(i.key_id, i.requests, i.total_tokens) for i in report.items] == [("k", 3, 130)]
    batch = [
        (r.key_id, r.deployment, r.requests, r.errors, r.prompt_tokens, r.completion_tokens)
        for r in report.batch
    ]
    assert batch == [("k", "chat", 2, 1, 20, 10)]


def test_fleetctl_usage_lists_batch_usage_apart(sqlite_server):
    dep = f"bu-{uuid.uuid4().hex[:8]}"
    records = [
        UsageRecord(cluster="east", key_id="kbu", deployment=dep, prompt_tokens=7),
        UsageRecord(
            cluster="east", key_id="kbu", deployment=dep, prompt_tokens=4, completion_tokens=2, batch=True,
            record_id=usage_record_id(f"batch_{dep}", 0),
        ),
    ]  # fmt: skip
    store_records(make_sessions(sqlite_server.database_url), records)
    report = json.loads(fleetctl(sqlite_server.home, "usage", "--deployment", dep, "-o", "json").stdout)
    assert [(i["key_id"], i["total_tokens"]) for i in report["items"]] == [("kbu", 13)]
    assert [(r["key_id"], r["requests"], r["completion_tokens"]) for r in report["batch"]] == [("kbu", 1, 2)]
    table = fleetctl(sqlite_server.home, "usage", "--deployment", dep, env={"COLUMNS": "200"}).stdout
    assert "batch usage (batch lines and async requests, included above)" in table
