"""What the batch end-to-end tests share: keys made as a user makes them (`fleetctl keys
create`), the unmodified OpenAI SDK pointed at a gateway, JSONL input files, polling a batch,
reading its output and error files, and the control plane's stored usage records of a batch
(read from its database file: the admin API shows usage only in aggregate)."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from fleet_base.batch.models import TERMINAL
from fleet_base.batch.names import usage_record_id
from tests.e2e.sim_fleet import SimFleet, wait_for
from tests.fleetctl import fleetctl_json

BATCH_METRICS_OF_A_BATCH = (  # the Grafana row's line metrics (webhooks: test_async_webhook.py)
    "fleet_batch_lines_queued",
    "fleet_batch_lines_in_flight",
    "fleet_batch_lines_completed_total",
    "fleet_batch_lines_failed_total",
    "fleet_batch_lines_retried_total",
    "fleet_batch_queue_seconds_bucket",
    "fleet_batch_batches",
    "fleet_batch_transitions_total",
)


@dataclass(frozen=True)
class Key:
    id: str
    secret: str
    webhook_secret: str | None


def new_key(fleet: SimFleet, name: str) -> Key:
    """A key made with `fleetctl keys create`, once every gateway accepts it and has bound
    the batch store (until then the Files and Batches API answers 503)."""
    row = fleetctl_json(fleet.home, "keys", "create", name)
    key = Key(row["key_id"], row["key"], row.get("webhook_secret"))
    headers = {"authorization": f"Bearer {key.secret}"}
    for url in fleet.gateways.values():
        wait_for(
            lambda url=url: httpx.get(f"{url}/v1/batches", headers=headers, timeout=5).status_code == 200,
            60,
            0.2,
            f"{url} to accept the key {name} and bind the batch store",
        )
    return key


def sdk(gateway: str, key: Key | str) -> openai.OpenAI:
    """The unmodified OpenAI SDK against one gateway."""
    secret = key.secret if isinstance(key, Key) else key
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=secret, timeout=60, max_retries=2)


def chat_line(custom_id: str, model: str, prompt: str, max_tokens: int, system: str | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(rows: list[dict | str]) -> bytes:
    """One line per row: a dict as JSON, a str as it is (a malformed line)."""
    return b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in rows)


def submit(client: openai.OpenAI, rows: list[dict | str], name: str = "in.jsonl") -> str:
    """Upload `rows` as a batch input file and create a chat batch on it; the batch id."""
    file = client.files.create(file=(name, io.BytesIO(jsonl(rows))), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def wait_batch(
    client: openai.OpenAI | Callable[[], openai.OpenAI],
    batch_id: str,
    statuses: frozenset[str] | set[str] = TERMINAL,
    timeout: float = 120,
) -> Any:
    """The batch once its status is one of `statuses` (a client factory: a fresh one each
    poll, for a gateway that may be restarting)."""

    def check():
        c = client() if callable(client) else client
        batch = c.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    return wait_for(check, timeout, 0.5, f"batch {batch_id} to reach {sorted(statuses)}")


def completed_count(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def usage_records(fleet: SimFleet, batch_id: str) -> list[tuple[str, bool]]:
    """(record_id, batch flag) of every usage record the control plane stored for the
    batch's lines."""
    db = fleet.home / "fleet.db"
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        rows = conn.execute(
            "SELECT record_id, batch FROM usage_records WHERE record_id LIKE ?",
            (usage_record_id(batch_id, 0).rsplit(".", 1)[0] + ".%",),
        ).fetchall()
    return [(r, bool(b)) for r, b in rows]


def wait_usage(
    fleet: SimFleet, batch_id: str, want: int, timeout: float = 60
) -> list[tuple[str, bool | None]]:
    """The batch's stored usage records once there are `want` of them, re-read after a
    pause (a late record would be a line booked twice)."""
    wait_for(lambda: len(usage_records(fleet, batch_id)) >= want, timeout, 0.5, f"{want} usage records")
    time.sleep(2.0)
    return usage_records(fleet, batch_id)


def line_index(line: dict) -> int:
    """The input line's index an output line answers (`batch_req_<hex>_<index>`)."""
    return int(line["id"].rsplit("_", 1)[1])


def assert_exactly_once(
    fleet: SimFleet, client: openai.OpenAI, batch_id: str, custom_ids: list[str]
) -> tuple[Any, list[dict]]:
    """The batch completed every line exactly once: one 200 output line per custom_id (no
    duplicate, none missing), no error line, request_counts to match, and the control
    plane's usage records of the batch exactly its output lines, each marked batch.
    Returns the batch and its output lines."""
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed", batch
    out = file_lines(client, batch.output_file_id)
    seen = Counter(line["custom_id"] for line in out)
    duplicates = sorted(c for c, n in seen.items() if n > 1)
    missing = sorted(set(custom_ids) - set(seen))
    assert not duplicates and not missing, f"duplicates {duplicates}, missing {missing}"
    assert len(out) == len(custom_ids) and set(seen) == set(custom_ids)
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in out)
    assert file_lines(client, batch.error_file_id) == []
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (
        len(custom_ids),
        len(custom_ids),
        0,
    ), counts
    records = wait_usage(fleet, batch_id, len(out))
    ids = Counter(r for r, _ in records)
    assert set(ids) == {usage_record_id(batch_id, line_index(line)) for line in out}, sorted(ids)
    assert sum(ids.values()) == len(out), ids.most_common(3)
    assert all(flag for _, flag in records), [r for r, flag in records if not flag]  # booked as batch
    return batch, out


def metric_names(gateway: str) -> set[str]:
    """The names of every series a gateway's /metrics exports now."""
    text = httpx.get(f"{gateway}/metrics", timeout=5).text
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}
