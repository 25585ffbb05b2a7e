"""Shadow traffic's cost to the client, and its verdicts: client TTFT with and without a
rollout's shadow phase in ONE run on the same fleet, and the greedy agreement the control
plane measures for an identical version and for a changed one.

A local fleet (nats-server, control plane, one agent + gateway, `sim` replicas: calibrated
timing, no model) serves a deployment under steady greedy chat streams (temperature 0)
through its gateway. Phases, one after the other on the same fleet:

1. no shadow;
2. a rollout whose shadow copies `--share` of the requests to a version whose engine flag
   does not change its output (`seed`), measured once copies flow; then aborted;
3. no shadow again (the gateway and the box after the copies);
4. a rollout shadowing a version whose output changes from token 1 (the sim's test device
   `text_diverge_at`): its verdict.

Printed: per phase, the client's TTFT p50/p90/p99 and their ratio to the no-shadow phases
pooled; the shadow comparison of both rollouts (copies, drops, errors, TTFT and ITL of the
copy against the original, greedy agreement and first differing token) and the rollouts'
verdicts. Measures, never asserts. From a checkout:

    nice -n 10 python -m bench.shadow --phase-s 20
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import console, print_table, run_main
from tests.e2e.sim_fleet import SimFleet, wait_for

NAME = "shadow-bench"
REGION = "local-east"
SIM_ARGS = {"cold_start": 0.2, "max_num_seqs": 16}


@dataclass
class Sample:
    phase: str
    ttft_s: float | None  # None: failed
    error: str = ""


@dataclass
class Clients:
    """Greedy chat streams through the gateway, `workers` at a time; each sample is filed
    under the phase current when its request began."""

    url: str
    key: str
    workers: int
    max_tokens: int
    phase: str = ""
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Clients:
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                phase = self.phase
                body = {
                    "model": NAME,
                    "messages": [
                        {"role": "user", "content": f"tell me about shadows {uuid.uuid4().hex[:6]}"}
                    ],
                    "max_tokens": self.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "user": uuid.uuid4().hex,
                }
                self.samples.append(self._one(client, body, headers, phase))

    def _one(self, client: httpx.Client, body: dict, headers: dict, phase: str) -> Sample:
        started = time.perf_counter()
        ttft = None
        done = False
        try:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    return Sample(phase, None, f"{r.status_code}: {r.read()[:120]!r}")
                for line in r.iter_lines():
                    if ttft is None and line.startswith("data: {") and '"content"' in line:
                        ttft = time.perf_counter() - started
                    if line.startswith("data: {") and '"error"' in line:
                        return Sample(phase, None, line[:160])
                    done = done or line.strip() == "data: [DONE]"
        except httpx.HTTPError as err:
            return Sample(phase, None, f"{type(err).__name__}: {err}")
        return Sample(phase, ttft) if done else Sample(phase, None, "the stream ended without [DONE]")

    def run_phase(self, phase: str, seconds: float) -> None:
        self.phase = phase
        time.sleep(seconds)


def rollout(fleet: SimFleet) -> dict[str, Any]:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


def start_shadow(fleet: SimFleet, engine_args: dict[str, Any], share: float, duration_s: float) -> int:
    r = fleet.api(
        "POST",
        f"/v1/deployments/{NAME}/rollouts",
        json={
            "spec": {"engine_args": {**SIM_ARGS, **engine_args}},
            "steps": [50, 100],
            "step_duration_s": 600,
            "min_requests": 5,
            "shadow_share": share,
            "shadow_duration_s": duration_s,
            # judged on agreement here: a copy's TTFT on a shared 2-core box swings with the load
            "shadow_max_ttft_p90_ratio": 20,
            "shadow_max_itl_p90_ratio": 20,
        },
    )
    if r.status_code != 201:
        raise SystemExit(f"the shadow rollout was refused: {r.status_code} {r.text}")
    return int(r.json()["canary_version"])


def end_rollout(fleet: SimFleet, replicas: int) -> None:
    if rollout(fleet).get("active"):
        fleet.api("POST", f"/v1/deployments/{NAME}/rollouts/current/abort")
    wait_for(lambda: not rollout(fleet)["active"], 60, 0.2, "the rollout to end")
    current = fleet.deployment(NAME)["current_version"]
    wait_for(lambda: fleet.ready_by_version(NAME) == {current: replicas}, 120, 0.2, "the baseline alone")


def copies_flowing(fleet: SimFleet) -> bool:
    return (
        fleet.gateway_metric(
            REGION, "fleet_gateway_shadow_requests_total", deployment=NAME, outcome="completed"
        )
        > 0
    )


def percentiles(values: list[float]) -> tuple[float, float, float]:
    a = np.asarray(values) * 1000
    return float(np.percentile(a, 50)), float(np.percentile(a, 90)), float(np.percentile(a, 99))


def ttft_table(samples: list[Sample], phases: list[str], base_phases: list[str]) -> list[list[object]]:
    base = percentiles([s.ttft_s for s in samples if s.phase in base_phases and s.ttft_s is not None])
    rows: list[list[object]] = []
    for phase in [*phases, "no shadow (pooled)"]:
        mine = [
            s
            for s in samples
            if (s.phase == phase or (phase.endswith("(pooled)") and s.phase in base_phases))
        ]
        ok = [s.ttft_s for s in mine if s.ttft_s is not None]
        if not ok:
            rows.append([phase, len(mine), len(mine), None, None, None, None, None, None])
            continue
        p = percentiles(ok)
        rows.append(
            [phase, len(mine), len(mine) - len(ok), *p, *(x / b for x, b in zip(p, base, strict=True))]
        )
    return rows


def pair(d: dict | None, key: str) -> str:
    v = (d or {}).get(key) or {}
    fmt = lambda x: "-" if x is None else f"{x * 1000:.1f}"  # noqa: E731
    return f"{fmt(v.get('original'))} / {fmt(v.get('copy'))}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds of each measured phase")
    p.add_argument("--share", type=float, default=0.5, help="the shadow's share of requests")
    p.add_argument("--workers", type=int, default=4, help="concurrent client streams")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fleet-shadow-") as tmp:
        fleet = SimFleet(Path(tmp) / "home", [REGION], slots=args.replicas * 4)
        try:
            fleet.up()
            fleet.deploy(NAME, args.replicas, engine_args=SIM_ARGS)
            fleet.wait_ready(NAME, args.replicas)
            clients = Clients(fleet.gateways[REGION], fleet.key, args.workers, args.max_tokens)
            clients.phase = "warm-up"
            clients.start()
            identical = changed = 0
            same: dict[str, Any] = {}
            other: dict[str, Any] = {}
            try:
                time.sleep(3)
                clients.run_phase("no shadow (before)", args.phase_s)

                clients.phase = "shadow starting"
                identical = start_shadow(fleet, {"seed": 7}, args.share, args.phase_s * 3 + 60)
                wait_for(lambda: copies_flowing(fleet), 120, 0.2, "copies to flow")
                clients.run_phase(f"{args.share:.0%} shadow", args.phase_s)
                same = rollout(fleet)
                clients.phase = "shadow ending"
                end_rollout(fleet, args.replicas)
                clients.run_phase("no shadow (after)", args.phase_s)

                clients.phase = "changed shadow"
                changed = start_shadow(fleet, {"text_diverge_at": 1}, args.share, 5)
                other = wait_for(
                    lambda: (r := rollout(fleet))["shadow"]["phase"] in ("passed", "stopped") and r,
                    120,
                    0.2,
                    "the changed version's verdict",
                )
                end_rollout(fleet, args.replicas)
            except (AssertionError, SystemExit, httpx.HTTPError) as err:  # print what was measured
                console.print(f"[red]stopped early:[/red] {err}")
            finally:
                clients.stop()
        finally:
            fleet.down()

    phases = ["no shadow (before)", f"{args.share:.0%} shadow", "no shadow (after)"]
    base = [phases[0], phases[2]]
    print_table(
        f"Client TTFT (ms) through the gateway, {args.workers} greedy streams of {args.max_tokens} tokens, "
        f"{args.phase_s:.0f} s a phase, one fleet",
        ["phase", "requests", "failed", "p50", "p90", "p99", "p50 ratio", "p90 ratio", "p99 ratio"],
        ttft_table(clients.samples, phases, base),
        caption="ratio: to the no-shadow phases pooled",
    )
    rows = []
    for label, version, ro in (
        ("identical (seed=7)", identical, same),
        ("changed (text_diverge_at=1)", changed, other),
    ):
        s = ro.get("shadow") or {}
        g = s.get("greedy") or {}
        rows.append([
            f"v{version} {label}", s.get("phase"), s.get("requests"), s.get("copies"), s.get("dropped"),
            json.dumps(s.get("errors")), pair(s, "ttft_p50_s"), pair(s, "itl_p50_s"), g.get("compared"),
            g.get("agreement"), g.get("first_diff_token_p50"), ro.get("phase"),
        ])  # fmt: skip
    print_table(
        "Shadow comparison (the control plane's, at the end of each shadow)",
        ["version", "shadow", "requests", "copies", "dropped", "errors", "TTFT p50 ms orig/copy",
         "ITL p50 ms orig/copy", "greedy compared", "agreement", "first diff p50", "rollout"],
        rows,
    )  # fmt: skip
    console.print(f"identical: {(same.get('shadow') or {}).get('reason')!r}; changed: {(other.get('shadow') or {}).get('reason')!r}"
                  f" -> {other.get('phase')} ({other.get('reason')})")  # fmt: skip
    failures = [s.error for s in clients.samples if s.ttft_s is None]
    console.print(f"client-visible failures: {len(failures)} {failures[:3]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"identical": same, "changed": other}, default=str, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
