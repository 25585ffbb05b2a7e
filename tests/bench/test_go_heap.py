"""bench.go_heap reads Go's text heap profile as `go tool pprof` would: records scaled for
sampling, attributed to the first frame outside the runtime, and the runtime's MemStats."""

from __future__ import annotations

import math

from bench import go_heap

PROFILE = """heap profile: 3: 3145728 [9: 9437184] @ heap/1048576
2: 2097152 [4: 4194304] @ 0x1 0x2 0x3
#\t0x1\truntime.mallocgc+0x104\t\t\truntime/malloc.go:1131
#\t0x2\tgithub.com/nats-io/nats-server/v2/server.getMsgBlockBuf+0x24\tserver/filestore.go:10
#\t0x3\tgithub.com/nats-io/nats-server/v2/server.(*msgBlock).loadMsgs+0x59\tserver/filestore.go:20

1: 1048576 [5: 5242880] @ 0x1 0x4
#\t0x1\truntime.mallocgc+0x104\t\t\truntime/malloc.go:1131
#\t0x4\tgithub.com/nats-io/nats-server/v2/server.newIPQueue+0x1\tserver/ipqueue.go:5

0: 0 [1: 64] @ 0x1 0x5
#\t0x5\tgithub.com/nats-io/nats-server/v2/server.gone+0x1\tserver/x.go:1


# runtime.MemStats
# Alloc = 983856
# HeapAlloc = 983856
# HeapInuse = 1867776
# HeapIdle = 5865472
# HeapReleased = 5832704
# NumGC = 7
"""


def test_records_are_scaled_and_named_by_their_first_frame_outside_the_runtime() -> None:
    heap = go_heap.parse(PROFILE)
    rate = 1048576 / 2
    scale = 1 / (1 - math.exp(-(2097152 / 2) / rate))  # two 1 MiB samples
    assert math.isclose(heap.sites["server.getMsgBlockBuf <- server.(*msgBlock).loadMsgs"], 2097152 * scale)
    assert "server.newIPQueue" in heap.sites and not any("gone" in k for k in heap.sites)  # nothing in use
    assert heap.memstats == {
        "HeapAlloc": 983856, "HeapInuse": 1867776, "HeapIdle": 5865472, "HeapReleased": 5832704, "NumGC": 7
    }  # fmt: skip


def test_growth_ranks_the_sites_that_grew_most() -> None:
    before = go_heap.GoHeap(sites={"a": 1 << 20, "b": 4 << 20})
    after = go_heap.GoHeap(sites={"a": 9 << 20, "b": 4 << 20, "c": 2 << 20})
    rows = go_heap.growth(before, after, most=2)
    assert [r[0] for r in rows] == ["a", "c"] and rows[0][3] == "+8.00"
