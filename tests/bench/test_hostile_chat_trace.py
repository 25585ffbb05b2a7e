"""`bench.hostile_chat_trace`: bursts, long prompts, long shared prefixes."""

from __future__ import annotations

import collections
import itertools
import math
from pathlib import Path

from bench.hostile_chat_trace import generate
from bench.multi_turn_trace import BLOCK_TOKENS, write_jsonl
from control_plane.simulate.bounds import ideal_reuse
from control_plane.simulate.trace import TraceRequest, load_trace


def test_the_trace_is_bursty_long_and_its_ids_say_what_repeats(tmp_path: Path) -> None:
    rows = generate(1800)
    assert len(rows) > 2000 and all(a[0] <= b[0] for a, b in itertools.pairwise(rows))
    assert all(len(ids) == math.ceil(prompt / BLOCK_TOKENS) for _, prompt, _, ids in rows)
    per_minute = sorted(collections.Counter(int(at // 60) for at, *_ in rows).values())
    assert per_minute[-1] >= 2.5 * per_minute[len(per_minute) // 2]  # bursts
    prompts = [prompt for _, prompt, _, _ in rows]
    assert sum(prompts) / len(prompts) >= 12_000  # long prompts, as the real trace's
    partial = [ids[-1] for _, prompt, _, ids in rows if prompt % BLOCK_TOKENS]
    assert len(set(partial)) == len(partial)  # a partial last block is each prompt's own
    trace = [TraceRequest(at, prompt, out, tuple(ids)) for at, prompt, out, ids in rows]
    assert 0.3 < ideal_reuse(trace) < 0.8  # shared system prompts and histories, and much new
    firsts = collections.Counter(ids[0] for _, _, _, ids in rows)
    assert firsts.most_common(1)[0][1] > 50 and len(firsts) > 50  # popular apps and a long tail
    write_jsonl(rows[:50], tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl")[0].hash_ids == tuple(rows[0][3])
