"""`bench.multi_turn_trace`: a multi-turn chat trace whose block ids say what repeats."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from bench.multi_turn_trace import BLOCK_TOKENS, generate, write_jsonl
from control_plane.simulate.sizing import cached_prefixes
from control_plane.simulate.trace import TraceRequest, load_trace


def test_turns_extend_their_conversation_and_apps_share_system_blocks(tmp_path: Path) -> None:
    rows = generate(900, seed=3, apps=2)
    assert len(rows) > 100 and all(a[0] <= b[0] for a, b in itertools.pairwise(rows))
    assert all(len(ids) == math.ceil(prompt / BLOCK_TOKENS) for _, prompt, _, ids in rows)
    # Most prompt tokens repeat a prefix seen before (earlier turns, shared system prompts).
    trace = [TraceRequest(at, prompt, out, tuple(ids)) for at, prompt, out, ids in rows]
    cached = cached_prefixes(trace, 10**9)
    assert sum(cached) > 0.5 * sum(r.prompt_tokens for r in trace)
    first_blocks = [ids[0] for _, prompt, _, ids in rows if prompt > BLOCK_TOKENS]
    assert (
        len(set(first_blocks)) <= 2 < len(first_blocks)
    )  # one system block per app (both over a block long here)
    partial = [ids[-1] for _, prompt, _, ids in rows if prompt % BLOCK_TOKENS]
    assert len(set(partial)) == len(partial)  # a partial last block is each prompt's own
    write_jsonl(rows, tmp_path / "t.jsonl")
    trace = load_trace(tmp_path / "t.jsonl")
    assert len(trace) == len(rows) and trace[0].hash_ids == tuple(rows[0][3])
