"""Table tests of fault classification: each NVML signal, the engine's errors, crash loops."""

from __future__ import annotations

import pytest

from agent.health.classify import (
    CrashWindow,
    Severity,
    classify_engine_error,
    classify_gpu,
    classify_replica_failure,
    classify_xid,
    evidence_line,
)
from agent.health.readings import GpuReading, XidEvent
from fleet_base.node_health import FaultKind, is_node_fault


def g(**kw) -> GpuReading:
    return GpuReading(index=kw.pop("index", 0), **kw)


@pytest.mark.parametrize(
    ("code", "kind", "severity"),
    [
        (13, FaultKind.xid, Severity.none),  # graphics engine exception: the application's
        (31, FaultKind.xid, Severity.none),  # GPU memory page fault: the application's
        (43, FaultKind.xid, Severity.none),
        (45, FaultKind.xid, Severity.none),
        (48, FaultKind.ecc_uncorrectable, Severity.severe),
        (63, FaultKind.retired_pages, Severity.severe),
        (64, FaultKind.retired_pages, Severity.severe),
        (79, FaultKind.fell_off_bus, Severity.severe),
        (74, FaultKind.xid, Severity.severe),
        (95, FaultKind.ecc_uncorrectable, Severity.severe),
        (119, FaultKind.xid, Severity.severe),
        (999, FaultKind.xid, Severity.soft),  # unknown: watched, not condemned
    ],
)
def test_xid_classes(code: int, kind: FaultKind, severity: Severity) -> None:
    assert classify_xid(code) == (kind, severity)


@pytest.mark.parametrize(
    ("prev", "cur", "expected"),
    [
        (None, g(), []),
        (g(), g(), []),
        (g(), g(lost=True), [(FaultKind.fell_off_bus, Severity.severe)]),
        (g(lost=True), g(lost=True), []),  # said once
        (g(), g(xids=[XidEvent(code=79)]), [(FaultKind.fell_off_bus, Severity.severe)]),
        (g(), g(xids=[XidEvent(code=13)]), [(FaultKind.xid, Severity.none)]),
        (
            g(ecc_volatile_uncorrected=0),
            g(ecc_volatile_uncorrected=1),
            [(FaultKind.ecc_uncorrectable, Severity.severe)],
        ),
        (g(ecc_volatile_uncorrected=2), g(ecc_volatile_uncorrected=2), []),
        (None, g(ecc_volatile_uncorrected=5), []),  # the first read is the baseline
        (
            g(ecc_aggregate_uncorrected=3),
            g(ecc_aggregate_uncorrected=4),
            [(FaultKind.ecc_uncorrectable, Severity.severe)],
        ),
        (
            g(ecc_volatile_uncorrected=0, ecc_aggregate_uncorrected=3),
            g(ecc_volatile_uncorrected=1, ecc_aggregate_uncorrected=4),
            [(FaultKind.ecc_uncorrectable, Severity.severe)],  # one rise, one fault
        ),
        (g(), g(retired_pages_pending=True), [(FaultKind.retired_pages, Severity.severe)]),
        (g(retired_pages_pending=True), g(retired_pages_pending=True), []),
        (g(), g(remap_failure=True), [(FaultKind.retired_pages, Severity.severe)]),
        (None, g(retired_pages_pending=True), [(FaultKind.retired_pages, Severity.severe)]),
        (g(), g(throttle_reasons=0x40, temperature_c=91), [(FaultKind.thermal, Severity.soft)]),
        (g(), g(throttle_reasons=0x8), [(FaultKind.thermal, Severity.soft)]),
        (g(throttle_reasons=0x40), g(throttle_reasons=0x40), []),
        (g(), g(throttle_reasons=0x1 | 0x4), []),  # idle / power cap: not a fault
    ],
)
def test_gpu_signals(prev, cur, expected) -> None:
    got = classify_gpu("n1", prev, cur, now=100.0)
    assert [(c.fault.kind, c.severity) for c in got] == expected
    assert all(c.fault.node == "n1" and c.fault.gpu == cur.index for c in got)


def test_xid_evidence_agrees_with_the_records_rule() -> None:
    for code in (13, 31, 43, 45, 68, 48, 79, 999):
        (c,) = classify_gpu("n", GpuReading(index=0), GpuReading(index=0, xids=[XidEvent(code=code)]), 1.0)
        assert is_node_fault(c.fault.kind, c.fault.evidence) == c.node_fault, code


def test_ecc_threshold() -> None:
    prev, cur = g(ecc_volatile_uncorrected=0), g(ecc_volatile_uncorrected=2)
    assert classify_gpu("n", prev, cur, 1.0, ecc_rise=3) == []
    assert len(classify_gpu("n", prev, g(ecc_volatile_uncorrected=3), 1.0, ecc_rise=3)) == 1


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("RuntimeError: CUDA error: an illegal memory access was encountered", FaultKind.cuda_error),
        ("CUDA error: device-side assert triggered", FaultKind.cuda_error),
        ("uncorrectable ECC error encountered", FaultKind.cuda_error),
        ("NVRM: Xid (PCI:0000:3b:00): 79", FaultKind.cuda_error),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", FaultKind.oom),
        ("torch.cuda.OutOfMemoryError", FaultKind.oom),
        ("ValueError: unknown flag --foo", None),
        ("", None),
    ],
)
def test_engine_errors(text: str, kind: FaultKind | None) -> None:
    assert classify_engine_error(text) == kind


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("the engine loop stalled (/health: stalled); killed", FaultKind.stall),
        (
            "exited with code 1; log tail:\nRuntimeError: CUDA error: unspecified launch failure",
            FaultKind.cuda_error,
        ),
        ("exited with code 1; log tail:\ntorch.OutOfMemoryError: CUDA out of memory", FaultKind.oom),
        ("exited with code 1; log tail:\nKeyError: 'x'", None),
    ],
)
def test_replica_failures(error: str, kind: FaultKind | None) -> None:
    assert classify_replica_failure(error) == kind


def test_evidence_is_the_line_that_says_it() -> None:
    error = "exited with code 1; log tail:\nloading\nRuntimeError: CUDA error: an illegal memory access\nbye"
    assert evidence_line(error) == "RuntimeError: CUDA error: an illegal memory access"
    assert evidence_line("the engine loop stalled (/health: stalled); killed\nx") == (
        "the engine loop stalled (/health: stalled); killed"
    )


def test_crash_loop_window() -> None:
    w = CrashWindow(crashes=3, window_s=60.0, seen={})
    assert [w.crash((0,), t, "a@1") for t in (0.0, 10.0)] == [False, False]
    assert w.crash((1,), 15.0, "b@1") is False  # other GPUs: their own count
    assert w.crash((0,), 20.0, "b@1") is True
    assert w.crash((0,), 21.0, "b@1") is False  # reported once; counting starts again
    spread = CrashWindow(crashes=3, window_s=60.0, seen={})
    assert [spread.crash((0,), t, f"v{t}") for t in (0.0, 50.0, 100.0)] == [False] * 3


def test_one_bad_version_is_no_crash_loop() -> None:
    w = CrashWindow(crashes=3, window_s=60.0, seen={})
    assert [w.crash((0,), t, "d@2") for t in (0.0, 1.0, 2.0, 3.0)] == [False] * 4
    assert w.crash((0,), 4.0, "other@1") is True
