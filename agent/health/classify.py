"""Raw signals -> faults, each with how much it says about the node (`Severity`).

- severe: the node is cordoned at once (a GPU off the bus, uncorrectable ECC, retired or
  unremappable memory, a hardware-class XID, a CUDA error from the engine, a crash loop,
  a confirmed wrong answer).
- soft: one may pass (thermal throttling, one stall, one crash, an XID of no known class):
  the node becomes suspect and is cordoned only when they repeat (agent.health.state).
- none: recorded, but not the node's fault (an out-of-memory; an application XID).

XID classes follow NVIDIA's XID catalogue ("XID Errors", docs.nvidia.com/deploy/xid-errors):
13 (graphics engine exception), 31 (GPU memory page fault), 43 (GPU stopped processing),
45 (preemptive cleanup) and 68 (video processor exception) are raised by a faulty
application or its teardown and clear with it; 48 (double-bit ECC), 63/64 (page
retirement / row remapping), 74 (NVLink), 79 (fallen off the bus), 92 (high single-bit
ECC rate), 94/95 (contained / uncontained ECC), 119/120 (GSP) and 61/62 (internal
micro-controller) point at the hardware. Pure and synchronous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from agent.health.readings import GpuReading
from fleet_base.node_health import APPLICATION_XIDS, FaultKind, NodeFault

HARDWARE_XIDS: dict[int, FaultKind] = {
    48: FaultKind.ecc_uncorrectable,
    94: FaultKind.ecc_uncorrectable,
    95: FaultKind.ecc_uncorrectable,
    63: FaultKind.retired_pages,
    64: FaultKind.retired_pages,
    79: FaultKind.fell_off_bus,
    61: FaultKind.xid,
    62: FaultKind.xid,
    74: FaultKind.xid,
    92: FaultKind.xid,
    119: FaultKind.xid,
    120: FaultKind.xid,
}
# nvmlClocksThrottleReason* bits that mean the hardware slowed itself down
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
THERMAL_BITS = HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN


class Severity(str, Enum):
    severe = "severe"
    soft = "soft"
    none = "none"


SEVERITY: dict[FaultKind, Severity] = {
    FaultKind.xid: Severity.soft,  # of no known class; hardware-class XIDs are made severe below
    FaultKind.ecc_uncorrectable: Severity.severe,
    FaultKind.retired_pages: Severity.severe,
    FaultKind.thermal: Severity.soft,
    FaultKind.fell_off_bus: Severity.severe,
    FaultKind.cuda_error: Severity.severe,
    FaultKind.oom: Severity.none,
    FaultKind.crash_loop: Severity.severe,
    FaultKind.stall: Severity.soft,
    FaultKind.wrong_answer: Severity.severe,
}


@dataclass(frozen=True)
class Classified:
    """A fault and what it says about its node."""

    fault: NodeFault
    severity: Severity

    @property
    def node_fault(self) -> bool:
        return self.severity != Severity.none


def classified(fault: NodeFault, severity: Severity | None = None) -> Classified:
    return Classified(fault, severity or SEVERITY[fault.kind])


def classify_xid(code: int) -> tuple[FaultKind, Severity]:
    """An XID's kind and severity; its evidence is written "Xid <code>", which
    fleet_base.node_health.is_node_fault reads the same way."""
    if code in APPLICATION_XIDS:
        return FaultKind.xid, Severity.none
    if code in HARDWARE_XIDS:
        return HARDWARE_XIDS[code], Severity.severe
    return FaultKind.xid, Severity.soft


def classify_gpu(
    node: str, prev: GpuReading | None, cur: GpuReading, now: float, *, ecc_rise: int = 1
) -> list[Classified]:
    """The faults one GPU's reading shows against its previous one (None: the first read,
    which sets the baselines of the cumulative counters and reports what is already bad)."""
    out: list[Classified] = []

    def add(
        kind: FaultKind, evidence: str, severity: Severity | None = None, at: float | None = None
    ) -> None:
        fault = NodeFault(node=node, gpu=cur.index, kind=kind, at=at or now, evidence=evidence[:512])
        out.append(classified(fault, severity))

    if cur.lost and not (prev and prev.lost):
        add(FaultKind.fell_off_bus, "NVML_ERROR_GPU_IS_LOST: the GPU has fallen off the bus")
    for event in cur.xids:
        kind, severity = classify_xid(event.code)
        add(kind, f"Xid {event.code}", severity, at=event.at)
    was, now_ecc = (prev.ecc_volatile_uncorrected if prev else None), cur.ecc_volatile_uncorrected
    if now_ecc is not None and was is not None and now_ecc - was >= ecc_rise:
        add(FaultKind.ecc_uncorrectable, f"volatile uncorrectable ECC errors {was} -> {now_ecc}")
    was_agg, agg = (prev.ecc_aggregate_uncorrected if prev else None), cur.ecc_aggregate_uncorrected
    if (
        agg is not None
        and was_agg is not None
        and agg - was_agg >= ecc_rise
        and not (now_ecc is not None and was is not None and now_ecc - was >= ecc_rise)
    ):  # the volatile count is reset by a driver reload; the aggregate survives it
        add(FaultKind.ecc_uncorrectable, f"aggregate uncorrectable ECC errors {was_agg} -> {agg}")
    if cur.retired_pages_pending and not (prev and prev.retired_pages_pending):
        add(FaultKind.retired_pages, "retired pages pending (a reset is needed)")
    if cur.remap_failure and not (prev and prev.remap_failure):
        add(FaultKind.retired_pages, "row remapping failed")
    hot = cur.throttle_reasons & THERMAL_BITS
    if hot and not (prev and prev.throttle_reasons & THERMAL_BITS):
        temp = f" at {cur.temperature_c:.0f} C" if cur.temperature_c is not None else ""
        add(FaultKind.thermal, f"clocks throttled by hardware (reasons 0x{hot:x}){temp}")
    return out


_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)
_DEVICE = re.compile(
    r"CUDA error|CUBLAS_STATUS|cuDNN error|NCCL error|illegal memory access|device-side assert"
    r"|uncorrectable ECC|ECC error|Xid|GPU is lost|fallen off the bus|unspecified launch failure",
    re.IGNORECASE,
)


def classify_engine_error(text: str) -> FaultKind | None:
    """The kind of an engine's fatal error text: a device error is a node fault
    (cuda_error), running out of memory is not (oom: the request's or the configuration's
    fault); None for anything else (a bug, a bad flag)."""
    if _OOM.search(text):
        return FaultKind.oom
    if _DEVICE.search(text):
        return FaultKind.cuda_error
    return None


def evidence_line(error: str) -> str:
    """The line of a failure's text that says what happened: the last one naming a device
    error or an out-of-memory (engine logs end with the exception), else the first."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for line in reversed(lines):
        if _OOM.search(line) or _DEVICE.search(line):
            return line[:300]
    return lines[0][:300] if lines else ""


def classify_replica_failure(error: str) -> FaultKind | None:
    """A replica's failure as the runtime reported it: the stall detector's verdict, or
    the engine's fatal error in its log tail."""
    first = error.splitlines()[0] if error else ""
    if "the engine loop stalled" in first:
        return FaultKind.stall
    return classify_engine_error(error)


@dataclass
class CrashWindow:
    """Crashes of replicas on the same GPUs (`key`) within a window: a crash loop at the
    Nth, provided they are of at least two deployment versions (`source`): one bad version
    crashes the same way wherever it runs, which is not the node's fault. Reported once per
    loop (counting starts again after it)."""

    crashes: int
    window_s: float
    seen: dict[tuple, list[tuple[float, str]]]

    def crash(self, key: tuple, now: float, source: str) -> bool:
        times = [(t, s) for t, s in self.seen.get(key, []) if now - t <= self.window_s] + [(now, source)]
        if len(times) >= self.crashes and len({s for _, s in times}) >= 2:
            self.seen.pop(key, None)
            return True
        self.seen[key] = times[-64:]
        return False
