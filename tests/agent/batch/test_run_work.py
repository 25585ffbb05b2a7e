"""The gateway's internal execution path: a work item runs as its owner key through the
same path as an interactive request (routing, retries, quota, usage), in the batch class,
whole; its usage record, under the line's own id whatever the answer, is handed back to
the worker (which books it only when its result is the one stored), never published here."""

from __future__ import annotations

from pathlib import Path

from agent.gateway.batch.work import WorkOutcome
from fleet_base.batch.models import WorkItem, now
from fleet_base.batch.names import result_key, usage_record_id
from fleet_base.openai_contract.priority import PRIORITY_CLASS_HEADER
from tests.agent.gateway.batch_fleet import DEPLOYMENT, Fleet, chat, status
from tests.agent.gateway.harness import make_key


def item(index: int = 0, key_id: str = "main", **body: object) -> WorkItem:
    return WorkItem(
        id=result_key("batch_x", index),
        kind="batch",
        parent_id="batch_x",
        index=index,
        custom_id=f"c{index}",
        endpoint="/v1/chat/completions",
        body=chat(f"line {index}", **body),
        key_id=key_id,
        deployment=DEPLOYMENT,
        priority=2,
        enqueued_at=now(),
        not_after=now() + 3600,
    )


async def test_a_line_answers_as_the_same_request_made_interactively(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    out = await fleet.gw.run_work(item(0, stream=True), "req-1")
    interactive = await fleet.post("main", chat("line 0"))
    assert (out.status, out.prompt_tokens, out.completion_tokens) == (200, 3, 2)
    assert out.body == interactive.json()
    batch_sent, interactive_sent = fleet.replicas.sent
    assert "stream" not in batch_sent.body  # whole, whatever the line asked
    assert batch_sent.headers[PRIORITY_CLASS_HEADER] == "batch"
    assert interactive_sent.headers[PRIORITY_CLASS_HEADER] == "standard"
    (inter,) = fleet.records  # the line's record is the worker's to book
    line = out.record
    assert line is not None
    assert (line.batch, line.record_id, line.key_id, line.prompt_tokens) == (
        True,
        usage_record_id("batch_x", 0),
        "main",
        3,
    )
    assert not inter.batch and inter.record_id != line.record_id


async def test_a_rerun_books_under_the_same_id(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    runs = [await fleet.gw.run_work(item(4), "req-1"), await fleet.gw.run_work(item(4), "req-2")]
    assert {r.record.record_id for r in runs if r.record} == {usage_record_id("batch_x", 4)}
    assert fleet.records == []


async def test_a_revoked_or_missing_key_fails_the_line_and_sends_nothing(tmp_path: Path) -> None:
    secret, revoked = make_key("gone", revoked=True)
    fleet = Fleet(tmp_path, {"main": make_key("main"), "gone": (secret, revoked)})
    for key_id in ("gone", "nobody"):
        out = await fleet.gw.run_work(item(0, key_id=key_id), "req-1")
        assert out.status == 401 and out.body["error"]["code"] == "invalid_api_key"
    assert fleet.replicas.sent == [] and fleet.records == []


async def test_a_replica_failure_is_retried_on_another_by_the_normal_path(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, replicas=2)
    fleet.replicas.behaviour["r1"] = status(500)
    fleet.replicas.behaviour["r2"] = status(500)
    out = await fleet.gw.run_work(item(0), "req-1")
    assert out.status == 500 and len(fleet.replicas.sent) == 2  # both tried
    assert out.record is not None and out.record.record_id == usage_record_id("batch_x", 0)
    assert all(r.attempt_failed for r in fleet.records)  # telemetry only, never billed
    fleet.replicas.behaviour.pop("r2")
    for _ in range(3):
        out = await fleet.gw.run_work(item(0), "req-2")
        assert out.status == 200
    assert out.record is not None and out.record.record_id == usage_record_id("batch_x", 0)


async def test_a_replicas_4xx_is_the_lines_final_answer(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.replicas.behaviour["r1"] = status(400)
    out = await fleet.gw.run_work(item(0), "req-1")
    assert isinstance(out, WorkOutcome) and out.status == 400 and out.body["error"]["message"] == "HTTP 400"
    assert out.record is not None and out.record.record_id == usage_record_id("batch_x", 0)


async def test_an_unknown_model_is_the_lines_404(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    bad = item(0).model_copy(update={"body": {**chat(), "model": "nope"}})
    out = await fleet.gw.run_work(bad, "req-1")
    assert out.status == 404 and out.body["error"]["code"] == "model_not_found"
