"""A constructed week through the real database: three pools on one cluster, replicas
written to the ledger as the reconcile and preemption hooks write them (a spot
interruption mid-week, a price change after the fact), usage stored as the usage loop
stores it, keys in two teams. `cost_report` must match the hand-computed tables.

Prices per GPU-hour: reserved "res" $2 (4 GPUs, $8 a 4-GPU node), spot $0.5, on-demand
"od" $3 ($6 a 2-GPU node). The week is 168 h from T0; H is an hour in seconds.

Replicas (GPU-hours and dollars inside the week):
  r1 chat  res  2 GPU  T0-24h .. running     168 h  336 GPU-h  $672 (reserved)
  r2 chat  spot 1 GPU  T0+24h .. T0+72h       48 h   48 GPU-h   $24 (spot interrupted)
  r3 chat  od   2 GPU  T0+72h .. T0+96h       24 h   48 GPU-h  $144 (its replacement, removed)
  r4 embed spot 1 GPU  T0+100h .. running     68 h   68 GPU-h   $34
  r5 batch od   1 GPU  T0-48h .. T0+12h       12 h   12 GPU-h   $36 (clipped at T0)
  r6 old   od   1 GPU  T0-100h .. T0-1h        0 h                $0 (before the week)
Reserved "res": 4 GPU x 168 h = 672 GPU-h = $1344; r1 used 336, so 336 GPU-h ($672) unused.
Total paid: 1344 + 24 + 144 + 34 + 36 = $1582.

Usage (latency, ttft; prefill = ttft or latency, decode = the rest):
  ka (search) chat  20 h, ttft 5 h     2.0M prompt, 1.0M completion
  kb (search) chat  10 h, no ttft      0.5M prompt, 0.1M completion
  kc (ads)    chat  24 h, ttft 4 h     1.0M prompt, 3.0M completion
  ka shadow   chat   6 h, ttft 1 h     0.1M prompt, 0.2M completion
  kd (none)   embed 17 h, no ttft      3.4M prompt, 0 completion
  kc (ads)    embed 17 h, no ttft      1.0M prompt, 0 completion
chat: held 168+48+24 = 240 replica-h, busy 20+10+24+6 = 60 h: utilisation 0.25, idle 0.75.
embed: held 68 h, busy 34 h: utilisation 0.5. batch: no requests, all idle.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from control_plane.cost import ledger
from control_plane.cost.report import cost_report
from control_plane.db import models as m
from control_plane.loops.usage import store_records
from control_plane.placement.base import Assignment
from fleet_base.protocol import UsageRecord

H = 3600.0
T0 = datetime(2026, 11, 23, tzinfo=timezone.utc)
SINCE, UNTIL = T0.timestamp(), T0.timestamp() + 168 * H


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


def _week(sessions) -> None:
    with sessions() as s:
        cluster = m.Cluster(id="c1", region="r")
        cluster.pools = [
            m.CapacityPool(
                name="res", gpu_model="H100", gpus_per_node=4, nodes=1, tier="reserved", hourly_price=8.0
            ),
            m.CapacityPool(
                name="spot", gpu_model="L4", gpus_per_node=1, nodes=4, tier="spot", hourly_price=0.5
            ),
            m.CapacityPool(
                name="od", gpu_model="L4", gpus_per_node=2, nodes=2, tier="on-demand", hourly_price=6.0
            ),
        ]
        s.add(cluster)
        for key_id, team in (("ka", "search"), ("kb", "search"), ("kc", "ads"), ("kd", None)):
            s.add(m.ApiKey(key_id=key_id, name=key_id, salt="s", hash="h", team=team))
        s.commit()

    def place(rid, dep, pool, gpus, hours):
        with sessions() as s:
            ledger.start(
                s,
                [Assignment(replica_id=rid, deployment=dep, version=1, cluster="c1", pool=pool, gpus=gpus)],
                at(hours),
            )
            s.commit()

    def stop(rid, reason, hours):
        with sessions() as s:
            ledger.end(s, [rid], reason, at(hours))
            s.commit()

    place("r6", "old", "od", 1, -100)
    place("r5", "batch", "od", 1, -48)
    stop("r6", ledger.REMOVED, -1)
    place("r1", "chat", "res", 2, -24)
    stop("r5", ledger.REMOVED, 12)
    place("r2", "chat", "spot", 1, 24)
    stop("r2", ledger.SPOT_INTERRUPTED, 72)
    place("r3", "chat", "od", 2, 72)
    with sessions() as s:  # a later price edit: r3's $3/GPU-h stays what it was
        s.query(m.CapacityPool).filter_by(name="od").one().hourly_price = 20.0
        s.commit()
    stop("r3", ledger.REMOVED, 96)
    place("r4", "embed", "spot", 1, 100)

    def use(key, dep, hours_at, latency_h, ttft_h, prompt, completion, shadow=False):
        return UsageRecord(
            cluster="c1", key_id=key, deployment=dep, at=at(hours_at).timestamp(),
            latency_s=latency_h * H, ttft_s=None if ttft_h is None else ttft_h * H,
            prompt_tokens=prompt, completion_tokens=completion, shadow=shadow,
        )  # fmt: skip

    store_records(
        sessions,
        [
            use("ka", "chat", 10, 20, 5, 2_000_000, 1_000_000),
            use("kb", "chat", 30, 10, None, 500_000, 100_000),
            use("kc", "chat", 80, 24, 4, 1_000_000, 3_000_000),
            use("ka", "chat", 90, 6, 1, 100_000, 200_000, shadow=True),
            use("kd", "embed", 110, 17, None, 3_400_000, 0),
            use("kc", "embed", 150, 17, None, 1_000_000, 0),
            use("ka", "chat", -1, 99, None, 9, 9),  # before the week: not in it
            use("ka", "chat", 168, 99, None, 9, 9),  # at its end: not in it
        ],
    )


# group: (gpu_hours, gpu_dollars, idle_dollars, prompt, completion, prefill_s, decode_s,
#         requests, utilisation, $/Mtok prefill, decode, total)
BY_DEPLOYMENT = {
    # r1 336 + r2 48 + r3 48 GPU-h; $672 + $24 + $144; idle 840 x 0.75; prefill 5+10+4+1 h,
    # decode 15+0+20+5 h; $/Mtok: 840 x 20/60 = 280 / 3.6M, 840 x 40/60 = 560 / 4.3M, 840 / 7.9M
    "chat": (432, 840, 630, 3_600_000, 4_300_000, 20 * H, 40 * H, 4, 0.25, 280 / 3.6, 560 / 4.3, 840 / 7.9),
    # r4 68 GPU-h x $0.5; idle 34 x 0.5; all prefill: $34 / 4.4M prompt tokens, no completion
    "embed": (68, 34, 17, 4_400_000, 0, 34 * H, 0, 2, 0.5, 34 / 4.4, None, 34 / 4.4),
    # r5 12 GPU-h x $3, no requests: all idle
    "batch": (12, 36, 36, 0, 0, 0, 0, 0, 0.0, None, None, None),
    # the reserved pool's 336 unused GPU-h x $2
    "(unallocated)": (336, 672, 672, 0, 0, 0, 0, 0, 0.0, None, None, None),
}
TIERS_BY_DEPLOYMENT = {
    "chat": {"reserved": 672, "spot": 24, "on-demand": 144},
    "embed": {"spot": 34},
    "batch": {"on-demand": 36},
    "(unallocated)": {"reserved": 672},
}

BY_KEY = {
    # chat x 20/60: $280 (idle 210, 144 GPU-h); prefill 280 x 5/20 = 70 / 2M, decode 210 / 1M
    "ka": (144, 280, 210, 2_000_000, 1_000_000, 5 * H, 15 * H, 1, 0.25, 35.0, 210.0, 280 / 3),
    # chat x 10/60: $140 (idle 105, 72 GPU-h); all prefill: 140 / 0.5M; decode $0 / 0.1M
    "kb": (72, 140, 105, 500_000, 100_000, 10 * H, 0, 1, 0.25, 280.0, 0.0, 140 / 0.6),
    # chat x 24/60 ($336, idle 252, 172.8 GPU-h) + embed x 17/34 ($17, idle 8.5, 34 GPU-h);
    # prefill 4+17 = 21 h, decode 20 h: 353 x 21/41 / 2M, 353 x 20/41 / 3M, 353 / 5M;
    # idle GPU-h 172.8 x 0.75 + 34 x 0.5 = 146.6 of 206.8
    "kc": (
        206.8,
        353,
        260.5,
        2_000_000,
        3_000_000,
        21 * H,
        20 * H,
        2,
        1 - 146.6 / 206.8,
        353 * 21 / 41 / 2,
        353 * 20 / 41 / 3,
        353 / 5,
    ),
    # embed x 17/34: $17 (idle 8.5, 34 GPU-h); $17 / 3.4M prompt tokens
    "kd": (34, 17, 8.5, 3_400_000, 0, 17 * H, 0, 1, 0.5, 5.0, None, 5.0),
    # the shadow copy: chat x 6/60 = $84 (idle 63, 43.2 GPU-h); 84 x 1/6 / 0.1M, 70 / 0.2M
    "(shadow)": (43.2, 84, 63, 100_000, 200_000, 1 * H, 5 * H, 1, 0.25, 140.0, 350.0, 280.0),
    # batch (nobody used it) $36 + unused reserved $672
    "(unallocated)": (348, 708, 708, 0, 0, 0, 0, 0, 0.0, None, None, None),
}

BY_TEAM = {
    # ka + kb: $420, idle 315, 216 GPU-h; prefill 15 h, decode 15 h: 210 / 2.5M, 210 / 1.1M
    "search": (216, 420, 315, 2_500_000, 1_100_000, 15 * H, 15 * H, 2, 0.25, 84.0, 210 / 1.1, 420 / 3.6),
    "ads": BY_KEY["kc"],
    "(none)": BY_KEY["kd"],
    "(shadow)": BY_KEY["(shadow)"],
    "(unallocated)": BY_KEY["(unallocated)"],
}

# by pool: (gpu_hours, gpu_dollars, idle_dollars, tiers); chat's usage split 336:48:48
BY_POOL = {
    # r1 $672 (idle 504) + 336 unused GPU-h $672
    "c1/res": (672, 1344, 504 + 672, {"reserved": 1344}),
    # r2 $24 (idle 18) + r4 $34 (idle 17)
    "c1/spot": (116, 58, 35, {"spot": 58}),
    # r3 $144 (idle 108) + r5 $36 (idle 36)
    "c1/od": (60, 180, 144, {"on-demand": 180}),
}


def _check(report, expected):
    got = {r.group: r for r in report.rows}
    assert set(got) == set(expected)
    for group, (
        gpu_h,
        dollars,
        idle,
        prompt,
        completion,
        prefill,
        decode,
        requests,
        util,
        *rates,
    ) in expected.items():
        row = got[group]
        assert (row.prompt_tokens, row.completion_tokens, row.requests) == (prompt, completion, requests), (
            group
        )
        assert row.gpu_hours == approx(gpu_h), group
        assert row.gpu_dollars == approx(dollars), group
        assert row.idle_dollars == approx(idle), group
        assert (row.prefill_s, row.decode_s) == (approx(prefill), approx(decode)), group
        assert row.utilisation == approx(util), group
        want = dict(zip(("prefill", "decode", "total"), rates))
        assert row.dollars_per_mtok == {k: None if v is None else approx(v) for k, v in want.items()}, group


def test_a_week_of_cost_by_deployment_key_team_and_pool(sessions):
    _week(sessions)
    with sessions() as s:
        by_dep = cost_report(s, SINCE, UNTIL, "deployment")
        by_key = cost_report(s, SINCE, UNTIL, "key")
        by_team = cost_report(s, SINCE, UNTIL, "team")
        by_pool = cost_report(s, SINCE, UNTIL, "pool")

    _check(by_dep, BY_DEPLOYMENT)
    assert {r.group: r.dollars_by_tier for r in by_dep.rows} == {
        g: {t: approx(d) for t, d in tiers.items()} for g, tiers in TIERS_BY_DEPLOYMENT.items()
    }
    assert [r.group for r in by_dep.rows] == ["chat", "(unallocated)", "batch", "embed"]  # dearest first
    _check(by_key, BY_KEY)
    _check(by_team, BY_TEAM)
    got = {r.group: (r.gpu_hours, r.gpu_dollars, r.idle_dollars, r.dollars_by_tier) for r in by_pool.rows}
    assert got == {
        g: (approx(h), approx(d), approx(i), {t: approx(v) for t, v in tiers.items()})
        for g, (h, d, i, tiers) in BY_POOL.items()
    }
    spot = next(r for r in by_pool.rows if r.group == "c1/spot")
    assert spot.prompt_tokens == 3_600_000 // 9 + 4_400_000  # chat's 48 of 432 GPU-h, and all of embed

    for report in (by_dep, by_key, by_team, by_pool):
        total = report.total
        assert total.gpu_dollars == approx(1582)  # 1344 reserved + 24 + 144 + 34 + 36
        assert total.dollars_by_tier == {
            "reserved": approx(1344),
            "spot": approx(58),
            "on-demand": approx(180),
        }
        assert total.gpu_hours == approx(848)  # 672 reserved + 116 spot + 60 on-demand
        assert total.idle_dollars == approx(630 + 17 + 36 + 672)
        assert total.utilisation == approx(1 - (324 + 34 + 12 + 336) / 848)  # idle GPU-h / GPU-h
        assert (total.prompt_tokens, total.completion_tokens, total.requests) == (8_000_000, 4_300_000, 6)
        assert report.hourly_dollars == approx(1582 / 168)
        assert (report.since, report.until) == (SINCE, UNTIL)


def test_the_ledger_kept_each_replicas_price_and_why_it_ended(sessions):
    _week(sessions)
    with sessions() as s:
        rows = {r.replica_id: (r.tier, r.hourly_price, r.end_reason) for r in s.query(m.ReplicaInterval)}
    assert rows == {
        "r1": ("reserved", 2.0, None),
        "r2": ("spot", 0.5, "spot_interrupted"),
        "r3": ("on-demand", 3.0, "removed"),  # started before the pool's price became $10/GPU-h
        "r4": ("spot", 0.5, None),
        "r5": ("on-demand", 3.0, "removed"),
        "r6": ("on-demand", 3.0, "removed"),
    }


def test_bad_group_or_window_is_refused(sessions):
    with sessions() as s, pytest.raises(ValueError, match="by must be one of"):
        cost_report(s, SINCE, UNTIL, "region")
    with sessions() as s, pytest.raises(ValueError, match="must end after"):
        cost_report(s, UNTIL, SINCE, "key")
