"""Prefill and decode from what the gateway now records for a non-streamed request: the
replica's own time to first token (its `x-fleet-ttft-s`) in `ttft_s`, so its decode time is
the rest of its latency, not zero. Stored as the usage loop stores records, read by
`cost_report`; the figures are hand-computed.

One on-demand replica, 1 GPU at $3/GPU-h, held the whole 2 h window: $6.
  n1 non-streamed  latency 0.4 h, ttft 0.1 h   1.0M prompt, 1.0M completion
  n2 non-streamed  latency 0.6 h, ttft 0.1 h   1.0M prompt, 2.0M completion
  o3 no ttft (a replica that said nothing)  latency 0.2 h   0.5M prompt, 0 completion
prefill 0.1 + 0.1 + 0.2 = 0.4 h, decode 0.3 + 0.5 = 0.8 h: busy 1.2 h of 2 (utilisation 0.6).
$6 by time: prefill $2 over 2.5M prompt tokens = $0.80/Mtok, decode $4 over 3M = $1.333/Mtok,
total $6 over 5.5M tokens.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from control_plane.cost.report import cost_report
from control_plane.db import models as m
from control_plane.loops.usage import store_records
from fleet_base.protocol import UsageRecord

H = 3600.0
T0 = datetime(2026, 11, 23, tzinfo=timezone.utc)


def test_non_streamed_records_with_ttft_have_decode_time_and_dollars(sessions) -> None:
    with sessions() as s:
        s.add(
            m.ReplicaInterval(
                replica_id="r1", deployment="chat", version=1, cluster="c1", pool="od",
                tier="on-demand", gpus=1, hourly_price=3.0, started_at=T0 - timedelta(hours=1),
            )
        )  # fmt: skip
        s.commit()

    def use(
        minutes: float, latency_h: float, ttft_h: float | None, prompt: int, completion: int
    ) -> UsageRecord:
        return UsageRecord(
            cluster="c1", key_id="k", deployment="chat", at=(T0 + timedelta(minutes=minutes)).timestamp(),
            latency_s=latency_h * H, ttft_s=None if ttft_h is None else ttft_h * H,
            prompt_tokens=prompt, completion_tokens=completion,
        )  # fmt: skip

    store_records(
        sessions,
        [
            use(10, 0.4, 0.1, 1_000_000, 1_000_000),
            use(40, 0.6, 0.1, 1_000_000, 2_000_000),
            use(70, 0.2, None, 500_000, 0),
        ],
    )
    with sessions() as s:
        report = cost_report(s, T0.timestamp(), T0.timestamp() + 2 * H, "deployment")
    (row,) = report.rows
    assert row.group == "chat" and row.requests == 3
    assert row.gpu_dollars == pytest.approx(6.0) and row.utilisation == pytest.approx(0.6)
    assert row.prefill_s == pytest.approx(0.4 * H) and row.decode_s == pytest.approx(0.8 * H)
    assert row.dollars_per_mtok == {
        "prefill": pytest.approx(2 / 2.5),
        "decode": pytest.approx(4 / 3),
        "total": pytest.approx(6 / 5.5),
    }
