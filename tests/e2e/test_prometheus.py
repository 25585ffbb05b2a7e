"""Observability against a real Prometheus (Debian's package): it scrapes a local sim
fleet (nats-server, control plane, two agents + gateways, simulated replicas) through the
targets file `fleetctl ps` writes, evaluates deploy/prometheus's SLO rules, and every
query of the Grafana dashboard, evaluated through Prometheus's HTTP API, returns series.
`promtool` checks the rule files and runs their unit tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from control_plane.local.prometheus_sd import TARGETS_FILE
from tests.e2e.observability_tools import Prometheus, require_tool
from tests.e2e.sim_fleet import Load, SimFleet, wait_for
from tests.test_deploy_assets import expressions

ROOT = Path(__file__).resolve().parents[2]
RULES = sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))
RULE_TESTS = sorted((ROOT / "deploy/prometheus/rules/tests").glob("*.yml"))
RATE_INTERVAL = "20s"  # what Grafana's $__rate_interval becomes at a 1 s scrape

pytestmark = pytest.mark.slow


def test_promtool_checks_and_tests_the_rules():
    promtool = require_tool("promtool")
    assert RULES and RULE_TESTS
    check = subprocess.run([promtool, "check", "rules", *map(str, RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert re.search(r"SUCCESS: \d+ rules found", check.stdout)
    unit = subprocess.run([promtool, "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    config = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(ROOT / "deploy/prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert config.returncode == 0, config.stdout + config.stderr


def fleetctl(home: Path, *args: str) -> str:
    env = {**os.environ, "FLEET_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("FLEET_API_URL", None)
    env.pop("FLEET_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-m", "control_plane.cli", *args], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def streams(gateways: list[str], key: str, stop: threading.Event) -> None:
    """Streaming chat requests (the gateway's TTFT histogram counts streams only)."""
    body = {"model": "web", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {key}"}) as client:
        n = 0
        while not stop.is_set():
            try:
                with client.stream(
                    "POST", f"{gateways[n % len(gateways)]}/v1/chat/completions", json=body
                ) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass
            n += 1
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_tool("prometheus")
    fleet = SimFleet(
        tmp_path_factory.mktemp("prom-home"),
        ["local-east", "local-west"],
        slots=4,
        gateway={"queue_timeout_s": 2},
    )
    try:
        fleet.up()
        spec = {"cold_start": 0.2, "max_num_seqs": 16, "error_rate": 0.2}
        r = fleet.api(
            "POST",
            "/v1/deployments",
            json={
                "name": "web",
                "model": "sim",
                "replicas": 2,
                "regions": ["local-east"],
                "engine_args": spec,
            },
        )
        assert r.status_code == 201, r.text
        wait_for(lambda: fleet.ready_by_version("web").get(1) == 2, 60, 0.2, "web's replicas")
        # a replica that never gets ready: its requests queue at the gateway, then time out
        r = fleet.api(
            "POST",
            "/v1/deployments",
            json={"name": "stuck", "model": "sim", "replicas": 1, "regions": ["local-west"],
                  "engine_args": {"cold_start": 3600}},
        )  # fmt: skip
        assert r.status_code == 201, r.text
        wait_for(lambda: fleet.deployment("stuck")["placements"], 60, 0.2, "stuck's replica placed")
        yield fleet
    finally:
        fleet.down()


def test_every_dashboard_query_returns_series(fleet: SimFleet, tmp_path):
    # the targets file, as `fleetctl up`/`ps` write it, linked where prometheus.yml looks
    targets_file = fleet.home / "local" / TARGETS_FILE

    def listed():
        fleetctl(fleet.home, "ps")
        groups = json.loads(targets_file.read_text())
        kinds = sorted(g["labels"]["kind"] for g in groups)
        return kinds == ["control-plane", "gateway", "gateway", "replica", "replica", "replica"] and groups

    groups = wait_for(listed, 30, 0.5, "every replica in the targets file")
    targets_dir = tmp_path / "targets"
    targets_dir.mkdir()
    (targets_dir / TARGETS_FILE).symlink_to(targets_file)
    prom = Prometheus(tmp_path, targets_dir).start()
    limited = fleet.api(
        "POST",
        "/v1/keys",
        json={"name": "limited", "scopes": ["inference"], "quotas": {"requests_per_minute": 2}},
    ).json()["key"]
    gateways = [fleet.gateways["local-east"], fleet.gateways["local-west"]]  # west forwards to east
    load = Load(gateways, fleet.key, "web", workers=2, pause_s=0.05).start()
    stop = threading.Event()
    streamer = threading.Thread(target=streams, args=(gateways, fleet.key, stop), daemon=True)
    streamer.start()
    try:

        def all_up():
            up = [t for t in prom.targets() if t["labels"].get("job") == "fleet" and t["health"] == "up"]
            return len(up) == len(groups) and up

        wait_for(all_up, 60, 0.5, "every fleet target up in Prometheus")

        def rate_limited():  # the 429s of a key over its requests_per_minute
            body = {"model": "web", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            r = httpx.post(f"{gateways[0]}/v1/chat/completions", json=body, timeout=10,
                           headers={"authorization": f"Bearer {limited}"})  # fmt: skip
            return r.status_code == 429

        wait_for(rate_limited, 30, 0.3, "a 429 from the limited key's quota")

        def queued():  # waits for the replica that never comes, then 503
            body = {"model": "stuck", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            with httpx.Client(timeout=30, headers={"authorization": f"Bearer {fleet.key}"}) as client:
                while not stop.is_set():
                    for url in gateways:
                        client.post(f"{url}/v1/chat/completions", json=body)

        threading.Thread(target=queued, daemon=True).start()

        queries = [
            expr.replace("$__rate_interval", RATE_INTERVAL).replace("$deployment", ".*")
            for expr in expressions()
        ]
        rules = [
            r["record"]
            for f in RULES
            for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"]
            if "record" in r
        ]
        missing: dict[str, int] = {}

        def every_query_answers():
            missing.clear()
            for expr in [*queries, *rules]:
                if not prom.query(expr):
                    missing[expr] = 0
            return not missing

        started = time.monotonic()
        try:
            wait_for(
                every_query_answers, 90, 1.0, "every dashboard query and recording rule to return series"
            )
        except AssertionError:
            raise AssertionError(
                f"no series for: {json.dumps(sorted(missing), indent=1)}\n{prom.log_tail()}"
            ) from None
        print(f"\n[prometheus] {len(queries)} dashboard queries and {len(rules)} recording rules return series "
              f"({time.monotonic() - started:.1f}s after all {len(groups)} targets were up)")  # fmt: skip
        # the numbers behind them are the fleet's: two ready replicas, both clusters healthy
        (ready,) = prom.query('fleet_control_plane_ready_replicas{deployment="web"}')
        assert float(ready["value"][1]) == 2
        healthy = prom.query('fleet_control_plane_clusters{status="healthy"}')
        assert float(healthy[0]["value"][1]) == 2
        forwarded = prom.query('sum(fleet_gateway_forwarded_total{cluster="local-west",deployment="web"})')
        assert forwarded and float(forwarded[0]["value"][1]) > 0, "west forwards web's requests to east"
        alerts = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert sum(len(g["rules"]) for g in alerts) >= 15 and all(
            r["health"] == "ok" for g in alerts for r in g["rules"]
        ), alerts
    finally:
        stop.set()
        load.stop()
        streamer.join(35)
        prom.stop()
