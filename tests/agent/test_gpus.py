"""GPU assignment of the process runtime: the allocator's invariants (property test), the
host inventory, and stand-in replicas started, refused, freed and adopted on an 8-GPU host."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent import inventory
from agent.runtime.base import InvalidSpec
from agent.runtime.gpus import GpuAllocator, GpusUnavailable, cuda_env, replica_gpu_count, visible_indices
from agent.runtime.process import ProcessRuntime
from agent.runtime.sim import SimRuntime
from fleet_base.protocol import ReplicaSpec, ReplicaState, Resources
from tests.agent.conftest import cluster_config
from tests.agent.test_foreign_engine import _spec, _stand_in
from tests.polling import eventually

REPLICAS = [f"r{i}" for i in range(6)]
# Mostly small asks with a heavy tail of whole-node ones (TP=8 next to single-GPU replicas).
COUNTS = st.one_of(st.integers(1, 2), st.sampled_from([4, 8, 9]))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.sampled_from(REPLICAS), COUNTS),
        st.tuples(st.just("release"), st.sampled_from(REPLICAS), st.just(0)),
        st.tuples(st.just("claim"), st.sampled_from(REPLICAS), st.lists(st.integers(-1, 9), max_size=4)),
    ),
    max_size=60,
)


@given(size=st.integers(0, 8), ops=OPS)
def test_no_index_is_held_twice_or_outside_the_inventory(size: int, ops: list) -> None:
    alloc = GpuAllocator(range(size))
    for op, rid, arg in ops:
        before = alloc.held()
        if op == "allocate":
            try:
                got = alloc.allocate(rid, arg)
            except (GpusUnavailable, InvalidSpec):
                assert rid not in alloc.held()
                if arg <= size:  # refused only when the others hold too many
                    others = sum(len(d) for r, d in before.items() if r != rid)
                    assert size - others < arg
            else:
                assert len(got) == (arg if size else 0)
        elif op == "release":
            alloc.release(rid)
            assert rid not in alloc.held()
        else:
            alloc.claim(rid, arg)
        held = [i for devices in alloc.held().values() for i in devices]
        assert len(held) == len(set(held)) and set(held) <= set(range(size))
        assert sorted(held + alloc.free()) == list(range(size))


@pytest.mark.parametrize(
    ("engine", "gpu_count", "args", "gpus"),
    [
        ("fleet", 1, {}, 1),
        ("fleet", 2, {}, 2),
        ("vllm", 1, {"tensor_parallel_size": 4}, 4),
        ("vllm", 8, {"tensor_parallel_size": 4}, 8),
        ("sglang", 1, {"tp": 2, "pp_size": 2}, 4),
        ("llama.cpp", 2, {}, 2),
    ],
)
def test_a_replica_spans_its_parallel_size_or_its_count(engine, gpu_count, args, gpus) -> None:
    spec = ReplicaSpec(
        replica_id="r", deployment="d", version=1, model="/m.gguf", engine=engine,
        resources=Resources(gpu_count=gpu_count), engine_args=args,
    )  # fmt: skip
    assert replica_gpu_count(spec) == gpus


def test_environment_round_trip_and_the_hosts_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert visible_indices(cuda_env([4, 5])) == [4, 5] and cuda_env([]) == {}
    assert visible_indices({}) is None and visible_indices({"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}) is None
    monkeypatch.setattr(inventory, "detect_gpus", lambda: [("H100", 80.0)] * 4)
    assert inventory.gpu_indices({}) == [0, 1, 2, 3]
    assert inventory.gpu_indices({"CUDA_VISIBLE_DEVICES": "2,3,7"}) == [2, 3]  # the agent's own share
    monkeypatch.setattr(inventory, "detect_gpus", lambda: [])
    assert inventory.gpu_indices({}) == []


def _visible(pid: int | None) -> str | None:
    assert pid is not None
    return psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES")


async def test_replicas_on_one_host_get_their_own_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_LLAMA_SERVER", str(_stand_in(tmp_path)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = cluster_config(tmp_path, "nats://127.0.0.1:1")
    rt = ProcessRuntime(config, gpus=range(8))
    four = Resources(gpu_count=4)
    model = str(tmp_path / "m.gguf")
    a = await rt.start(_spec(model=model, replica_id="a", resources=four))
    b = await rt.start(_spec(model=model, replica_id="b", resources=four))
    try:
        assert (a.gpus, _visible(a.pid)) == ([0, 1, 2, 3], "0,1,2,3")
        assert (b.gpus, _visible(b.pid)) == ([4, 5, 6, 7], "4,5,6,7")
        with pytest.raises(GpusUnavailable, match="0 of this host's 8 are free"):
            await rt.start(_spec(model=model, replica_id="c"))
        assert not (rt.logs_dir / "c.log").exists()  # not started at all
        await rt.kill(a)
        assert rt.gpus.free() == [0, 1, 2, 3]

        async def b_ready() -> bool:
            return (await rt.poll(b)).state == ReplicaState.ready

        await eventually(b_ready, 20, "b answers", 0.05)
        # a restarted agent finds b's devices in its environment, even without runtime.json's
        again = ProcessRuntime(config, gpus=range(8))
        assert await again.adopt(b.model_copy(update={"gpus": []}))
        assert again.gpus.held() == {"b": (4, 5, 6, 7)}
        await again.close()
    finally:
        await rt.kill(a)
        await rt.kill(b)
        await rt.close()
    assert rt.gpus.held() == {}
    assert SimRuntime(config).gpus.inventory == ()  # a simulated replica runs on no GPU
