"""The OpenAI Batch API end to end, through the unmodified `openai` SDK, on a local fleet of
real processes (nats-server, control plane, an agent and its gateway, a real engine replica
of SmolLM2-135M), with keys made by `fleetctl keys create`:

- a 200-line JSONL of greedy chat requests (varied prompts, small `max_tokens`) plus five
  malformed lines is uploaded, a batch created and polled to `completed`: the output file has
  one line per valid `custom_id`, each body's `choices` equal to the same request sent
  interactively through the gateway; every malformed line is in the error file with its
  reason; `request_counts` add up; the control plane's usage records of the batch are its
  output lines, each once;
- a running batch cancelled ends `cancelled` with its finished part in the output file, the
  rest in the error file as `batch_cancelled`, and nothing of it run afterwards (its usage
  records are its output lines, and stay so);
- another key sees neither the batches nor their files (404);
- every line metric of the Grafana "Batch and async" row has series on the gateway.

Expiry of `completion_window` ("24h" only, as OpenAI's) is tested with a shortened window in
tests/agent/batch/test_batches_live.py; a real fleet cannot wait a day."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from fleet_base.batch.names import usage_record_id
from tests.e2e.batch_tools import (
    BATCH_METRICS_OF_A_BATCH,
    Key,
    chat_line,
    completed_count,
    file_lines,
    jsonl,
    line_index,
    metric_names,
    new_key,
    sdk,
    submit,
    usage_records,
    wait_batch,
    wait_usage,
)
from tests.e2e.sim_fleet import SimFleet, start_threads, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


REGION = "local-east"
MODEL = "chat"
LINES = 200
DISTINCT = 40  # distinct requests; each sent LINES / DISTINCT times under its own custom_id
SUBJECTS = [
    "the moon", "a violin", "Paris", "photosynthesis", "the Pacific", "a compiler", "bread",
    "winter", "a lighthouse", "the number seven", "bees", "a glacier", "chess", "copper",
    "a river delta", "thunder", "a library", "volcanoes", "the alphabet", "a bicycle",
]  # fmt: skip
SYSTEMS = [None, "Answer in one short sentence.", "You are a terse encyclopedia."]
MALFORMED = {  # custom_id (as the error line names it) -> (raw line, the reason's code)
    "": ('{"custom_id": "torn", "method": "POST", "url": "/v1/chat', "invalid_json_line"),
    "ghost-model": (
        '{"custom_id": "ghost-model", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}}',
        "model_not_found",
    ),
    "wrong-url": (
        '{"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", '
        '"body": {"model": "chat", "input": "hi"}}',
        "mismatched_endpoint",
    ),
    "streamed": (
        '{"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]}}',
        "unsupported_value",
    ),
    "line-0": (  # a second line with the first line's custom_id
        '{"custom_id": "line-0", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"model": "chat", "messages": [{"role": "user", "content": "again"}]}}',
        "duplicate_custom_id",
    ),
}


def request_of(i: int) -> tuple[str, int, str | None]:
    """(prompt, max_tokens, system) of distinct request `i`."""
    subject = SUBJECTS[i % len(SUBJECTS)]
    verb = ("Describe", "Tell me one fact about")[i // len(SUBJECTS) % 2]
    return f"{verb} {subject}.", 4 + i % 4, SYSTEMS[i % len(SYSTEMS)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[SimFleet]:
    fleet = SimFleet(
        tmp_path_factory.mktemp("batch"),
        [REGION],
        slots=1,
        runtime="process",
        replica_args=["--threads", "1", "--max-model-len", "512", "--log-level", "warning"],
    )
    try:
        fleet.up()
        r = fleet.api("POST", "/v1/deployments", json={"name": MODEL, "model": "smollm2-135m", "replicas": 1})
        assert r.status_code == 201, r.text
        fleet.wait_ready(MODEL, 1, timeout=300)
        yield fleet
    finally:
        fleet.down()


@pytest.fixture(scope="module")
def alice(fleet: SimFleet) -> Key:
    return new_key(fleet, "alice")


@pytest.fixture(scope="module")
def client(fleet: SimFleet, alice: Key) -> openai.OpenAI:
    return sdk(fleet.gateways[REGION], alice)


def interactive_choices(fleet: SimFleet, key: Key, count: int) -> dict[int, list[dict]]:
    """Distinct request i -> the `choices` the gateway answers when it is sent interactively
    (four at a time), as the JSON it sent."""
    out: dict[int, list[dict]] = {}

    def run(worker: int) -> None:
        with httpx.Client(timeout=120, headers={"authorization": f"Bearer {key.secret}"}) as http:
            for i in range(worker, count, 4):
                body = chat_line("", MODEL, *request_of(i))["body"]
                r = http.post(f"{fleet.gateways[REGION]}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                out[i] = r.json()["choices"]

    for t in start_threads(run, 4):
        t.join(300)
    assert len(out) == count
    return out


@dataclass(frozen=True)
class Submitted:
    batch_id: str
    file_id: str
    data: bytes
    at: float  # time.monotonic() of the create


@pytest.fixture(scope="module")
def big(client: openai.OpenAI) -> Submitted:
    """The 200-line batch (five malformed lines among them), uploaded and created once."""
    rows: list[dict | str] = [chat_line(f"line-{n}", MODEL, *request_of(n % DISTINCT)) for n in range(LINES)]
    rows[50:50] = [raw for raw, _ in MALFORMED.values()]  # among the valid lines, not at the end
    data = jsonl(rows)
    file = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return Submitted(batch.id, file.id, data, time.monotonic())


def test_the_upload_is_validated_and_only_its_key_sees_it(
    fleet: SimFleet, client: openai.OpenAI, big: Submitted
) -> None:
    file = client.files.retrieve(big.file_id)
    assert (file.purpose, file.bytes, file.filename) == ("batch", len(big.data), "requests.jsonl"), file
    assert client.files.content(big.file_id).content == big.data
    batch = wait_batch(client, big.batch_id, {"in_progress", "finalizing", "completed"}, timeout=60)
    assert (batch.endpoint, batch.input_file_id, batch.completion_window) == (
        "/v1/chat/completions",
        big.file_id,
        "24h",
    )
    counts = batch.request_counts  # every line counted, the malformed ones failed at validation
    assert counts is not None and (counts.total, counts.failed) == (LINES + len(MALFORMED), len(MALFORMED))
    assert big.batch_id in {b.id for b in client.batches.list().data}

    bob = sdk(fleet.gateways[REGION], new_key(fleet, "bob"))
    assert bob.batches.list().data == []
    for call in (
        lambda: bob.batches.retrieve(big.batch_id),
        lambda: bob.batches.cancel(big.batch_id),
        lambda: bob.files.retrieve(big.file_id),
        lambda: bob.files.content(big.file_id),
        lambda: bob.files.delete(big.file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    r = httpx.get(
        f"{fleet.gateways[REGION]}/v1/batches/{big.batch_id}",
        headers={"authorization": f"Bearer {fleet.key}"},
        timeout=10,
    )
    assert r.status_code == 404 and r.json()["error"]["message"], r.text  # OpenAI's error shape
    assert client.batches.retrieve(big.batch_id).id == big.batch_id  # still there for its owner


def test_the_batch_completes_with_the_interactive_answers_and_its_error_lines(
    fleet: SimFleet, alice: Key, client: openai.OpenAI, big: Submitted
) -> None:
    done = wait_batch(client, big.batch_id, timeout=400)
    batch_s = time.monotonic() - big.at
    assert done.status == "completed", done

    out = file_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(f"line-{n}" for n in range(LINES))
    errors = file_lines(client, done.error_file_id)
    assert sorted((e["custom_id"], e["error"]["code"]) for e in errors) == sorted(
        (custom_id, code) for custom_id, (_, code) in MALFORMED.items()
    ), errors
    for e in errors:  # a reason a person can act on, naming the line
        assert e["response"] is None and e["error"]["message"].startswith("Line "), e
    counts = done.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (LINES + len(MALFORMED), LINES, len(MALFORMED))
    records = wait_usage(fleet, big.batch_id, LINES)
    assert len(records) == LINES and len({r for r, _ in records}) == LINES, len(records)
    assert all(flag for _, flag in records), [r for r, flag in records if not flag]  # booked as batch
    usage = fleet.api("GET", "/v1/usage", params={"since": "1h"}).json()[
        "batch"
    ]  # as fleetctl usage lists it
    assert [(u["key_id"], u["deployment"], u["requests"]) for u in usage] == [(alice.id, MODEL, LINES)], usage
    bob = sdk(fleet.gateways[REGION], new_key(fleet, "bob-2"))
    for file_id in (done.output_file_id, done.error_file_id):
        with pytest.raises(openai.NotFoundError):
            bob.files.content(file_id or "")

    started = time.monotonic()
    reference = interactive_choices(fleet, alice, DISTINCT)
    interactive_s = time.monotonic() - started
    differ = []
    for line in out:
        n = int(line["custom_id"].removeprefix("line-"))
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion", line
        if body["choices"] != reference[n % DISTINCT]:
            differ.append((line["custom_id"], body["choices"], reference[n % DISTINCT]))
    assert not differ, f"{len(differ)} lines differ from the interactive answer, e.g. {differ[:3]}"
    sample = reference[3][0]["message"]["content"]
    print(
        f"\n[batch] {LINES} lines + {len(MALFORMED)} malformed: completed {batch_s:.1f} s after create "
        f"({LINES / batch_s:.1f} lines/s on one SmolLM2 replica); every body's choices equal the "
        f"interactive answer ({DISTINCT} distinct requests, {interactive_s:.1f} s interactively), "
        f"e.g. {request_of(3)[0]!r} -> {sample!r}; {len(records)} usage records, one per line"
    )


def test_a_cancelled_batch_keeps_its_finished_part_and_runs_nothing_after(
    fleet: SimFleet, client: openai.OpenAI
) -> None:
    total = 60
    rows: list[dict | str] = [
        chat_line(f"c-{n}", MODEL, f"Write about {SUBJECTS[n % len(SUBJECTS)]} #{n}.", 24)
        for n in range(total)
    ]
    batch_id = submit(client, rows, "cancel.jsonl")
    wait_for(lambda: completed_count(client, batch_id) >= 3, 120, 0.3, "three lines completed")
    assert client.batches.cancel(batch_id).status == "cancelling"
    done = wait_batch(client, batch_id, timeout=120)
    assert done.status == "cancelled", done
    out = file_lines(client, done.output_file_id)
    errors = file_lines(client, done.error_file_id)
    assert 3 <= len(out) < total, len(out)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}, errors[:3]
    assert sorted(line["custom_id"] for line in out + errors) == sorted(f"c-{n}" for n in range(total))
    assert all(line["response"]["status_code"] == 200 for line in out)
    counts = done.request_counts
    assert counts is not None and counts.completed == len(out), counts
    records = wait_usage(fleet, batch_id, len(out))
    time.sleep(3.0)  # nothing of the batch runs after it is cancelled
    assert usage_records(fleet, batch_id) == records, "a line of the cancelled batch ran after it"
    booked = sorted(r for r, _ in records)
    assert booked == sorted(usage_record_id(batch_id, line_index(line)) for line in out), booked
    in_flight = fleet.gateway_metric(REGION, "fleet_batch_lines_in_flight")
    assert in_flight == 0, in_flight
    print(
        f"\n[batch] cancelled after {len(out)} of {total} lines; the other {len(errors)} are batch_cancelled"
    )


def test_the_grafana_rows_line_metrics_have_series(fleet: SimFleet) -> None:
    names = metric_names(fleet.gateways[REGION])
    missing = [m for m in BATCH_METRICS_OF_A_BATCH if m not in names]
    assert not missing, missing
    assert fleet.gateway_metric(REGION, "fleet_batch_lines_completed_total") >= LINES
    assert fleet.gateway_metric(REGION, "fleet_batch_queue_seconds_count") >= LINES
