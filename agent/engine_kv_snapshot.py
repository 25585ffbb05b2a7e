"""engine_kv_events.json in the cluster's state_dir: what happened to the KV events of this
agent's vLLM and SGLang replicas (agent.engine_kv_subscriber), by engine and outcome, since
the agent started; written by the agent, read by the gateway for
`fleet_agent_engine_kv_events_total{engine,outcome}` on its /metrics (as nodes.json feeds
the node metrics).

Outcomes count blocks (stored, removed, unknown_parent, unknown_block, block_size,
malformed, group, evicted, skipped) or messages (batches, gap, replayed, duplicate,
replay_timeout, stale, restart, invalid, oversize, rate, cleared)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from pydantic import BaseModel, Field, ValidationError

from fleet_base.local_state import LocalState

ENGINE_KV_FILE = "engine_kv_events.json"
MAX_SERIES = 256


class OutcomeCount(BaseModel):
    engine: str = Field(max_length=32)
    outcome: str = Field(max_length=32)
    count: int = Field(0, ge=0)


class EngineKvSnapshot(BaseModel):
    counts: list[OutcomeCount] = Field(default_factory=list, max_length=MAX_SERIES)
    updated_at: float = Field(default_factory=time.time)


def snapshot(counts: Mapping[tuple[str, str], int]) -> EngineKvSnapshot:
    rows = [OutcomeCount(engine=e, outcome=o, count=n) for (e, o), n in sorted(counts.items())]
    return EngineKvSnapshot(counts=rows[:MAX_SERIES])


def save(files: LocalState, counts: Mapping[tuple[str, str], int]) -> None:
    files.write_bytes(files.dir / ENGINE_KV_FILE, snapshot(counts).model_dump_json().encode())


def load(files: LocalState) -> EngineKvSnapshot | None:
    try:
        return EngineKvSnapshot.model_validate_json((files.dir / ENGINE_KV_FILE).read_bytes())
    except (OSError, ValidationError, ValueError):
        return None
