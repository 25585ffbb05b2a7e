"""The correctness probe: each replica answers a fixed greedy request once it is ready
(its start-up answer), and again every `probe_idle_s` while idle (every `probe_busy_s`
while busy). An answer that differs from the replica's own start-up answer, or from the
start-up answer most other replicas of the same deployment version agree on, is a
mismatch: the replica is suspect and probed again at once; a second mismatch in a row
confirms it (a wrong_answer fault), and that replica is probed no more. A `/health` at 200
says a process is up; this says its answers are still right.

Only replicas of an engine whose greedy output is batch-invariant (`CAPABILITIES[...]
.batch_invariant`: Fleet's own) are probed: vLLM, SGLang and llama.cpp may answer a greedy
prompt differently depending on what they batch it with, which would read as a wrong answer.

`ProbeTracker` is the policy (pure; the caller passes `now`); `ask` is the request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx

from fleet_base.cluster_config import HealthConfig
from fleet_base.openai_contract.continuation import TOKEN_IDS_FIELD, TOKEN_IDS_HEADER

PROBE_PROMPT = "The capital of France is"

Answer = tuple[int, ...] | str


class Verdict(str, Enum):
    baseline = "baseline"  # the start-up answer, recorded
    ok = "ok"
    suspect = "suspect"  # one mismatch: probe again at once
    wrong = "wrong"  # confirmed: a wrong_answer fault


@dataclass
class _Probed:
    group: str
    baseline: Answer | None = None
    last_at: float | None = None
    suspect: bool = False
    condemned: bool = False
    answer: Answer | None = None


@dataclass
class ProbeTracker:
    settings: HealthConfig
    replicas: dict[str, _Probed] = field(default_factory=dict)

    def due(self, replica_id: str, group: str, now: float, busy: bool) -> bool:
        r = self.replicas.setdefault(replica_id, _Probed(group))
        if r.condemned:
            return False
        if r.baseline is None or r.suspect or r.last_at is None:
            return True
        every = self.settings.probe_busy_s if busy else self.settings.probe_idle_s
        return now - r.last_at >= every

    def reference(self, replica_id: str, group: str) -> Answer | None:
        """The start-up answer most other replicas of `group` agree on (at least two of
        them, and more than half); None when there is no such agreement."""
        others = [
            r.baseline
            for rid, r in self.replicas.items()
            if rid != replica_id and r.group == group and r.baseline is not None and not r.condemned
        ]
        if not others:
            return None
        answer, n = Counter(others).most_common(1)[0]
        return answer if n >= 2 and n * 2 > len(others) else None

    def observe(self, replica_id: str, group: str, answer: Answer, now: float) -> Verdict:
        r = self.replicas.setdefault(replica_id, _Probed(group))
        r.last_at, r.answer = now, answer
        if r.baseline is None:
            r.baseline = answer
            peer = self.reference(replica_id, group)
            if peer is None or peer == answer:
                return Verdict.baseline
        elif not self._differs(replica_id, group, answer):
            r.suspect = False
            return Verdict.ok
        if r.suspect:
            r.suspect, r.condemned = False, True
            return Verdict.wrong
        r.suspect = True
        return Verdict.suspect

    def _differs(self, replica_id: str, group: str, answer: Answer) -> bool:
        peer = self.reference(replica_id, group)
        return answer != self.replicas[replica_id].baseline or (peer is not None and answer != peer)

    def expected(self, replica_id: str) -> Answer | None:
        r = self.replicas.get(replica_id)
        if r is None:
            return None
        return self.reference(replica_id, r.group) or r.baseline

    def forget(self, keep: set[str]) -> None:
        for rid in [rid for rid in self.replicas if rid not in keep]:
            del self.replicas[rid]


async def ask(
    http: httpx.AsyncClient, url: str, deployment: str, headers: dict[str, str], max_tokens: int
) -> Answer | None:
    """The replica's answer to the probe: its token ids where it gives them, else its text;
    None when it did not answer (its liveness is the runtime's and stall detector's job)."""
    body: dict[str, Any] = {
        "model": deployment,
        "prompt": PROBE_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
    }
    try:
        r = await http.post(f"{url}/v1/completions", json=body, headers={**headers, TOKEN_IDS_HEADER: "1"})
        if r.status_code != 200:
            return None
        choice = r.json()["choices"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    ids = choice.get(TOKEN_IDS_FIELD)
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return tuple(ids)
    return str(choice.get("text", ""))
