"""The process runtime against real engine replicas on a tiny random checkpoint:
start -> ready, adoption by a second runtime (as after an agent restart), drain on stop,
crash reporting with exit code and log tail, and refusal to adopt a reused pid."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from agent.runtime.base import InvalidSpec, Probe, ReplicaHandle
from agent.runtime.process import ProcessRuntime
from fleet_base.cluster_config import ClusterConfig
from fleet_base.protocol import ReplicaSpec, ReplicaState
from tests.agent.conftest import cluster_config
from tests.polling import eventually


def spec(model: Path | str, rid: str = "r1", **engine_args: object) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=rid, deployment="tiny", version=1, model=str(model), engine_args=engine_args
    )


async def wait_state(
    rt: ProcessRuntime, handle: ReplicaHandle, state: ReplicaState, timeout: float = 60
) -> Probe:
    """The first probe in `state`; a replica that fails on the way fails the test at once."""

    async def reached() -> Probe | None:
        probe = await rt.poll(handle)
        if probe.state == state:
            return probe
        assert probe.state != ReplicaState.failed, probe.error
        return None

    return await eventually(reached, timeout, f"replica {state}", 0.1)


@pytest.fixture
def config(tmp_path: Path) -> ClusterConfig:
    return cluster_config(tmp_path, "nats://127.0.0.1:1")


async def test_start_ready_adopt_and_drain(config: ClusterConfig, model_dir: Path) -> None:
    rt = ProcessRuntime(config)
    handle = await rt.start(spec(model_dir, max_num_seqs=2))
    assert "--max-num-seqs" in handle.argv and handle.create_time is not None
    assert (await rt.poll(handle)).state == ReplicaState.starting  # listening or not, not ready yet
    await wait_state(rt, handle, ReplicaState.ready)
    async with httpx.AsyncClient(base_url=handle.url, timeout=30) as http:
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
    log = Path(handle.log_path).read_text()
    assert log.startswith("--- ") and "agent starts:" in log

    # A new runtime (as in a restarted agent) adopts the live replica from its persisted handle.
    saved = ReplicaHandle.model_validate_json(handle.model_dump_json())
    rt2 = ProcessRuntime(config)
    assert await rt2.adopt(saved)
    assert (await rt2.poll(saved)).state == ReplicaState.ready
    code = await rt2.stop(saved, drain_timeout_s=5)
    assert code is None  # not our child: exit code unknown, but it is gone
    probe = await rt.poll(handle)  # the original parent sees how it ended: drained, exit 0
    assert (probe.state, probe.exit_code) == (ReplicaState.failed, 0)
    await rt.close()
    await rt2.close()


async def test_crash_is_reported_with_exit_code_and_log_tail(config: ClusterConfig, tmp_path: Path) -> None:
    rt = ProcessRuntime(config)
    handle = await rt.start(spec(tmp_path / "no-such-model"))
    probe = await wait_state(rt, handle, ReplicaState.failed)
    assert probe.exit_code == 1  # the engine listened, then failed to load
    assert "exited with code 1" in probe.error and "no-such-model" in probe.error
    await rt.close()


async def test_bad_spec_never_starts(config: ClusterConfig) -> None:
    rt = ProcessRuntime(config)
    with pytest.raises(InvalidSpec, match="set by the agent"):
        await rt.start(spec("m", port=1))
    await rt.close()


async def test_adopt_refuses_a_reused_or_dead_pid(config: ClusterConfig) -> None:
    rt = ProcessRuntime(config)
    base = dict(replica_id="r1", spec=spec("m"), url="http://127.0.0.1:1", port=1)
    # pid alive but not an engine (this test process): pid reuse, never adopted nor killed
    assert not await rt.adopt(ReplicaHandle(pid=os.getpid(), **base))
    assert not await rt.adopt(ReplicaHandle(pid=2**22 + 12345, **base))
    assert not await rt.adopt(ReplicaHandle(pid=None, **base))
    await rt.close()


class ChattyRuntime(ProcessRuntime):
    """Replicas that only write: 4 KiB numbered lines, 2 MB/s, to their stdout."""

    def replica_argv(self, spec: ReplicaSpec, port: int) -> list[str]:
        code = (
            "import sys, time\n"
            "i = 0\n"
            "while True:\n"
            "    sys.stdout.write(f'line {i:08d} ' + 'x' * 4080 + '\\n'); sys.stdout.flush()\n"
            "    i += 1; time.sleep(0.002)\n"
        )
        return [sys.executable, "-c", code, "engine.server", str(port)]


async def test_a_chatty_replica_log_is_rotated_and_stays_bounded(tmp_path: Path) -> None:
    """A replica writing 4+ MB keeps its log under log_max_bytes with log_backups copies,
    keeps running, and its latest output lands in the current file (appends after the
    truncation, no hole of zeros)."""
    max_bytes, slack = 256 * 1024, 128 * 1024
    config = cluster_config(
        tmp_path, "nats://127.0.0.1:1", replica={"log_max_bytes": max_bytes, "log_backups": 2}
    )
    rt = ChattyRuntime(config)
    handle = await rt.start(spec("m"))
    log = Path(handle.log_path)

    def lines_written() -> int:
        text = log.read_bytes()[-8192:].decode(errors="replace")
        numbers = [int(line[5:13]) for line in text.splitlines() if line.startswith("line ")]
        return max(numbers, default=0)

    async def wrote_4mb() -> bool:
        probe = await rt.poll(handle)
        assert probe.state != ReplicaState.failed, probe.error
        assert log.stat().st_size <= max_bytes + slack
        return lines_written() >= 1024  # 4 MiB of lines

    await eventually(wrote_4mb, 60, "4 MiB written", 0.02)
    backups = sorted(p.name for p in log.parent.iterdir() if p.name.startswith(log.name + "."))
    assert backups == [log.name + ".1", log.name + ".2"]
    sizes = [log.stat().st_size] + [(log.parent / b).stat().st_size for b in backups]
    assert all(size <= max_bytes + slack for size in sizes), sizes
    assert sum(sizes) < 1024 * 4096 // 2  # well under what it wrote
    assert b"\0" not in log.read_bytes()  # O_APPEND: writes go on at the new end
    first = int((log.parent / backups[0]).read_text().splitlines()[-1][5:13])
    assert lines_written() > first  # the replica kept writing into the rotated file
    await rt.kill(handle)
    await rt.close()
