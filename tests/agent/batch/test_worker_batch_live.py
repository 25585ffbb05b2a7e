"""A batch end to end in one process: the unmodified OpenAI SDK against a live gateway on
a real nats-server, its own worker running every line through the gateway's path to
replicas played by a mock transport. The output has one line per custom_id, each body the
replica's answer to that line, and the usage records are one per line, marked batch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx

from fleet_base.batch.names import usage_record_id
from fleet_base.openai_contract.priority import PRIORITY_CLASS_HEADER
from fleet_base.protocol import UsageRecord
from tests.agent.batch.test_batches_live import KEY, config, gateway_on, lines_of, status_is
from tests.agent.gateway.batch_fleet import Replicas
from tests.agent.gateway.harness import ClusterFiles, replica, route

LINES = 12


def jsonl(n: int) -> io.BytesIO:
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4},
        }
        for i in range(n)
    ]
    return io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))


async def test_the_worker_completes_a_batch_through_the_gateway(tmp_path: Path, nats_server) -> None:
    cfg = config(tmp_path, nats_server.url)
    reps = [replica(f"r{i}", f"http://r{i}", deployment="tiny") for i in (1, 2)]
    ClusterFiles(cfg.state_dir, cfg.cluster).write(replicas=reps, keys=[KEY], routes=[route("tiny", [])])
    async with gateway_on(cfg) as (gw, client):
        replicas = Replicas()
        gw.upstreams.client = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
        records: list[UsageRecord] = []
        gw.usage.submit = records.append  # type: ignore[method-assign]
        file = await client.files.create(file=("in.jsonl", jsonl(LINES)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await status_is(client, batch.id, "completed")
        done = await client.batches.retrieve(batch.id)
        out = await lines_of(client, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"line-{i}" for i in range(LINES))
        for r in out:
            i = int(r["custom_id"].split("-")[1])
            assert r["response"]["status_code"] == 200
            content = r["response"]["body"]["choices"][0]["message"]["content"]
            assert content == "ok:" + json.dumps([{"content": f"say {i}", "role": "user"}], sort_keys=True)
        assert done.request_counts is not None and done.request_counts.completed == LINES
        assert len(replicas.sent) == LINES
        assert {s.headers[PRIORITY_CLASS_HEADER] for s in replicas.sent} == {"batch"}
        line_records = [r for r in records if r.batch]
        assert sorted(r.record_id or "" for r in line_records) == sorted(
            usage_record_id(batch.id, i) for i in range(LINES)
        )
        metrics = gw.metrics.render().decode()
        assert f'fleet_batch_lines_completed_total{{deployment="tiny"}} {float(LINES)}' in metrics
