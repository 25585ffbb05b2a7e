"""The batch store's own costs on one local nats-server (file store), each against its
baseline in the same run:

- enqueue: `NatsBatchStore.enqueue` (publishes in flight `PUBLISH_WINDOW` at a time, each
  acknowledged) against one acknowledged publish after another;
- a worker's loop without inference: pull 32, store each result (create-once), ack;
- a file's contents: the object store read of `ObjectStoreBlobs.get` against nats-py's
  `ObjectStore.get` (which appends chunk to bytes).

    PYTHONPATH=. .venv/bin/python -m bench.batch_store --items 5000 --file-mib 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import nats

from bench.common import print_table, run_main
from control_plane.local.nats_server import NatsServer
from fleet_base.batch import names
from fleet_base.batch.config import BatchConfig
from fleet_base.batch.models import LineResult, StoredResult, WorkItem
from fleet_base.batch.nats_store import MSG_ID, open_batch_store
from fleet_base.batch.resources import ensure_batch_resources
from fleet_base.jetstream_budget import JetStreamBudget


def items(parent: str, n: int) -> list[WorkItem]:
    now = time.time()
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 1500}], "max_tokens": 64}
    return [
        WorkItem(
            id=names.result_key(parent, i),
            kind="batch",
            parent_id=parent,
            index=i,
            custom_id=f"c{i}",
            endpoint="/v1/chat/completions",
            body=body,
            key_id="k",
            deployment="d",
            priority=2,
            enqueued_at=now,
            not_after=now + 3600,
        )
        for i in range(n)
    ]


async def run(n: int, file_mib: int) -> list[tuple]:
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await ensure_batch_resources(js, JetStreamBudget(store_bytes=4 << 30))
            store = await open_batch_store(nc, BatchConfig())

            work = items("batch_seq", n)
            start = time.perf_counter()
            for item in work:
                subject = names.work_subject(item.deployment, item.priority, item.parent_id)
                await js.publish(subject, item.model_dump_json().encode(), headers={MSG_ID: item.id})
            sequential = n / (time.perf_counter() - start)
            await js.purge_stream(names.STREAM_WORK)

            start = time.perf_counter()
            await store.enqueue(items("batch_win", n))
            windowed = n / (time.perf_counter() - start)
            rows.append(("enqueue (items/s)", windowed, sequential, windowed / sequential))

            start = time.perf_counter()
            done = 0
            while done < n:
                for d in await store.pull("d", 2, 32, 2.0):
                    line = LineResult(id="r", custom_id=d.item.custom_id)
                    await store.put_result(d.item.id, StoredResult(line=line))
                    await d.ack()
                    done += 1
            rate = n / (time.perf_counter() - start)
            rows.append(("pull + put_result + ack (lines/s)", rate, None, None))

            data = os.urandom(file_mib << 20)
            start = time.perf_counter()
            await store.blobs.put("bench", data)
            put_s = time.perf_counter() - start
            start = time.perf_counter()
            assert await store.blobs.get("bench") == data
            ours = time.perf_counter() - start
            start = time.perf_counter()
            theirs_data = (await (await js.object_store(names.OBJECT_BUCKET_FILES)).get("bench")).data
            theirs = time.perf_counter() - start
            assert theirs_data == data
            mb = len(data) / 1e6
            rows.append((f"object put {file_mib} MiB (MB/s)", mb / put_s, None, None))
            rows.append((f"object get {file_mib} MiB (MB/s)", mb / ours, mb / theirs, theirs / ours))
            await nc.close()
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--file-mib", type=int, default=20)
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args.items, args.file_mib))
    print_table(
        "batch store on one local nats-server",
        ["operation", "ours", "baseline", "ours / baseline"],
        rows,
        caption="baselines: one acknowledged publish at a time; nats-py ObjectStore.get",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
