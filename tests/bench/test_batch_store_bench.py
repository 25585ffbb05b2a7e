"""The batch store benchmark on tiny sizes, so it does not rot."""

from __future__ import annotations

from bench import batch_store


async def test_bench_runs_on_tiny_sizes() -> None:
    rows = await batch_store.run(50, 1)
    assert [r[0].split(" (")[0] for r in rows] == [
        "enqueue",
        "pull + put_result + ack",
        "object put 1 MiB",
        "object get 1 MiB",
    ]
    assert all(r[1] > 0 for r in rows)
