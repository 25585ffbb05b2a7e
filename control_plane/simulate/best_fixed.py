"""The best fixed fleet: the cheapest static answer a policy is read against. It is the
smallest static replica count whose run has at least the target share of requests within the
TTFT target. The target is 99%; where no fleet size reaches 99% because some requests cannot
meet the TTFT target at all (their own prefill is longer), it is the ceiling a very large fleet
reaches minus half a point.

Found by search over static runs (`run(n)`, a full simulation per count), not by a model:

- ceiling: from `start` (the static run's count), the count doubles while the attainment stays
  under 99%, until doubling gains under `SATURATED` and the larger fleet either queues almost
  nothing (p99 queue under `QUEUE_FREE_S`) or queues no less than `QUEUE_CUT` of what the smaller
  one did: more replicas no longer cut the queue. An overwhelmed small fleet can plateau too,
  but its queue still falls with each doubling. The last attainment is the ceiling (at most
  `CEILING_MAX` replicas, said when cut there);
- the smallest count: bisection between 0 (fails) and the smallest count seen to pass;
- attainment is nearly but not exactly monotone in the count (which replica a request lands on,
  and when drained replicas are released, change with the count), so after the bisection the
  `SCAN_BELOW` counts under the answer are run too and the smallest passing count is taken,
  repeating below it. A pass further down, under a failing stretch longer than that, is not
  seen; `non_monotone` says whether any run count did worse than a smaller one."""

from __future__ import annotations

from collections.abc import Callable

from control_plane.simulate.report import BestFixedFleet, PolicyReport

TARGET = 0.99
CEILING_MARGIN = 0.005  # half a point under the ceiling
SATURATED = 0.001  # doubling the fleet gains under 0.1 points: the ceiling
QUEUE_FREE_S = 0.1  # a fleet whose p99 queue is under this has no queue more replicas would cut
QUEUE_CUT = 0.6  # a doubling that leaves more than this share of the p99 queue did not cut it
CEILING_MAX = 1024
SCAN_BELOW = 2


def search(run: Callable[[int], PolicyReport], start: int) -> BestFixedFleet:
    """The best fixed fleet, from static runs of `run(count)` (each count run once)."""
    seen: dict[int, PolicyReport] = {}

    def at(n: int) -> float:
        if n not in seen:
            seen[n] = run(n)
        return seen[n].within_ttft_target

    top = max(1, start)
    saturated = at(top) >= TARGET
    while not saturated and top < CEILING_MAX:
        bigger = min(CEILING_MAX, 2 * top)
        flat = at(bigger) - at(top) < SATURATED
        queue, before = seen[bigger].queue_p99_s, seen[top].queue_p99_s
        top = bigger
        saturated = at(top) >= TARGET or (flat and (queue < QUEUE_FREE_S or queue > QUEUE_CUT * before))
    ceiling = at(top)
    if ceiling >= TARGET:
        target, basis = TARGET, "99%"
    else:
        target, basis = round(ceiling - CEILING_MARGIN, 5), "ceiling - 0.5 points"
    lo, hi = 0, min(n for n in seen if at(n) >= target)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid) >= target:
            hi = mid
        else:
            lo = mid
    below = hi - 1
    while below >= 1 and below >= hi - SCAN_BELOW:  # hi moves down with each pass found
        if at(below) >= target:
            hi = below
        below -= 1
    runs = sorted((n, seen[n].within_ttft_target) for n in seen)
    non_monotone = any(a[1] > b[1] for i, a in enumerate(runs) for b in runs[i + 1 :])
    best = seen[hi]
    if basis == "99%":
        how = "target 99% within TTFT"
    else:
        cut = "" if saturated else f", not saturated at the {CEILING_MAX} cap"
        how = (
            f"no fleet reaches 99%: {top} replicas reach {100 * ceiling:.2f}% (the ceiling{cut}), "
            f"target {100 * target:.2f}% (0.5 points under it)"
        )
    why = f"{how}; the smallest count reaching it, of {len(runs)} fixed fleets run" + (
        "; attainment not monotone in the count" if non_monotone else ""
    )
    return BestFixedFleet(
        replicas=hi,
        gpu_hours=best.gpu_hours,
        within_ttft_target=best.within_ttft_target,
        target=target,
        target_basis=basis,
        ceiling=ceiling,
        ceiling_replicas=top,
        ceiling_saturated=saturated,
        non_monotone=non_monotone,
        runs=runs,
        summary=best.model_copy(update={"timeline": []}),
        why=why,
    )
