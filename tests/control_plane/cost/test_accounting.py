"""The cost rules as table tests over plain rows (no database)."""

from __future__ import annotations

import pytest

from control_plane.cost.accounting import Interval, PoolPrice, build_report, overlap_s, phase_seconds, request

H = 3600.0


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (2 * H, 3 * H, 1 * H),  # inside the window
        (-5 * H, 1 * H, 1 * H),  # started before it: clipped at since
        (9 * H, 12 * H, 1 * H),  # ends after it: clipped at until
        (8 * H, None, 2 * H),  # still running: runs to until
        (-5 * H, None, 10 * H),  # covers the whole window
        (-5 * H, -1 * H, 0.0),  # ended before it
        (11 * H, None, 0.0),  # started after it
    ],
)
def test_window_clipping(start, end, expected):
    assert overlap_s(start, end, 0.0, 10 * H) == expected


@pytest.mark.parametrize(
    ("latency", "ttft", "expected"),
    [
        (2.0, 0.5, (0.5, 1.5)),  # a first token measured: prefill to it, decode the rest
        (2.0, None, (2.0, 0.0)),  # no first token measured: all prefill
        (2.0, 3.0, (2.0, 0.0)),  # a first token after the end is clamped
        (0.0, None, (0.0, 0.0)),
    ],
)
def test_phase_seconds(latency, ttft, expected):
    assert phase_seconds(latency, ttft) == expected


def test_reserved_pool_is_paid_for_the_whole_window_and_its_unused_part_is_idle():
    """4 reserved GPUs at $2/GPU-h over 10 h = $80, whatever runs: one 1-GPU replica for
    5 h is $10 of it (busy 1 h of 5: $8 idle), the 35 unused GPU-hours $70 of idle."""
    pools = [PoolPrice("c", "res", "reserved", gpus=4, hourly_price=2.0)]
    intervals = [Interval("chat", "c", "res", "reserved", 1, 2.0, 0.0, 5 * H)]
    usage = [request("k1", "chat", 100, 100, latency_s=H, ttft_s=0.25 * H)]
    by_dep = build_report(intervals, pools, usage, 0.0, 10 * H, "deployment")
    rows = {r.group: r for r in by_dep.rows}
    assert rows["chat"].gpu_dollars == pytest.approx(10.0)
    assert rows["chat"].idle_dollars == pytest.approx(8.0)
    assert rows["chat"].utilisation == pytest.approx(0.2)
    assert rows["(unallocated)"].gpu_dollars == pytest.approx(70.0) == rows["(unallocated)"].idle_dollars
    assert by_dep.total.gpu_dollars == pytest.approx(80.0)
    assert by_dep.total.dollars_by_tier == {"reserved": pytest.approx(80.0)}
    assert by_dep.hourly_dollars == pytest.approx(8.0)
    by_pool = build_report(intervals, pools, usage, 0.0, 10 * H, "pool")
    (pool,) = by_pool.rows
    assert (pool.group, pool.gpu_hours, pool.gpu_dollars) == (
        "c/res",
        pytest.approx(40.0),
        pytest.approx(80.0),
    )
    assert pool.idle_dollars == pytest.approx(78.0) and pool.prompt_tokens == 100


def test_zero_token_groups_have_no_dollars_per_mtok_and_an_unused_deployment_is_unallocated():
    intervals = [Interval("idle", "c", "od", "on-demand", 1, 1.0, 0.0, None)]
    usage = [request("k1", "other", 0, 0, latency_s=1.0)]  # a request with no tokens, no GPU time
    by_dep = {r.group: r for r in build_report(intervals, [], usage, 0.0, 2 * H, "deployment").rows}
    assert by_dep["idle"].dollars_per_mtok == {"prefill": None, "decode": None, "total": None}
    assert by_dep["idle"].utilisation == 0.0 and by_dep["idle"].idle_dollars == pytest.approx(2.0)
    assert by_dep["other"].dollars_per_mtok == {"prefill": None, "decode": None, "total": None}
    assert by_dep["other"].utilisation is None and by_dep["other"].requests == 1
    by_key = {r.group: r for r in build_report(intervals, [], usage, 0.0, 2 * H, "key").rows}
    assert by_key["(unallocated)"].gpu_dollars == pytest.approx(2.0)
    assert by_key["k1"].gpu_dollars == 0.0


def test_chargeback_by_busy_seconds_with_shadow_copies_charged_to_no_key():
    """$10 over 10 h of one replica; busy 1 h + 3 h + 1 h (shadow) of 10 h: k1 a fifth,
    k2 three fifths, "(shadow)" a fifth; each also carries that share of the $5 idle."""
    intervals = [Interval("chat", "c", "od", "on-demand", 1, 1.0, 0.0, 10 * H)]
    usage = [
        request("k1", "chat", 1_000_000, 0, latency_s=H, team="a"),
        request("k2", "chat", 1_000_000, 1_000_000, latency_s=3 * H, ttft_s=H, team="b"),
        request("k1", "chat", 5, 5, latency_s=H, shadow=True, team="a"),
    ]
    rows = {r.group: r for r in build_report(intervals, [], usage, 0.0, 10 * H, "key").rows}
    assert {g: r.gpu_dollars for g, r in rows.items()} == {
        "k1": pytest.approx(2.0),
        "k2": pytest.approx(6.0),
        "(shadow)": pytest.approx(2.0),
    }
    assert rows["k2"].idle_dollars == pytest.approx(3.0)
    # k2: $6 over 1 h prefill + 2 h decode: $2 per M prompt tokens, $4 per M completion tokens
    assert rows["k2"].dollars_per_mtok == {
        "prefill": pytest.approx(2.0),
        "decode": pytest.approx(4.0),
        "total": pytest.approx(3.0),
    }
    assert rows["k1"].dollars_per_mtok["decode"] is None  # no completion tokens
    teams = {r.group: r.gpu_dollars for r in build_report(intervals, [], usage, 0.0, 10 * H, "team").rows}
    assert teams == {"a": pytest.approx(2.0), "b": pytest.approx(6.0), "(shadow)": pytest.approx(2.0)}
    no_team = build_report(intervals, [], [request("k3", "chat", 1, 1, 1.0)], 0.0, 10 * H, "team")
    assert [r.group for r in no_team.rows] == ["(none)"]
