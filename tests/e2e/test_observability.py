"""Observability and the operator console end to end, on one local sim fleet of real
processes (nats-server, control plane, two agents + gateways, simulated replicas):

1. a real Prometheus (Debian's package) scrapes the fleet through the targets file
   `fleetctl ps` writes and evaluates deploy/prometheus's SLO rules; every query of the
   Grafana dashboard, evaluated through Prometheus's HTTP API, returns series; `promtool`
   checks the rule files and runs their unit tests;
2. the console in Debian's Chromium, driven by Playwright, one story in order: log in with
   the admin token; both clusters on the map and the deployment's replicas in both; a good
   canary progresses step by step and is promoted with the admin token; a bad canary rolls
   back by itself while its error-rate chart crosses the guard line; a read token sees no
   buttons and a forged promote with its own CSRF token is refused; the admin aborts; keys,
   events and audit pages. No page ever holds a token or the prompt text. Screenshots of
   each page go to FLEET_CONSOLE_SCREENSHOTS (docs/console/ when regenerating the docs),
   else to the test's temporary folder.

Deployments: `web` (both regions; the console's rollouts), `api` (east only, 20% of its
requests fail: errors, retries, and west forwarding to east for Prometheus), `stuck` (a
replica that never gets ready: requests queue at the gateway and time out)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from control_plane.local.prometheus_sd import TARGETS_FILE
from tests.e2e.observability_tools import (
    BROWSER_ERRORS,
    CHROMIUM,
    Prometheus,
    Shots,
    require_playwright,
    require_tool,
    streams,
    watch,
    watched,
)
from tests.e2e.sim_fleet import Load, SimFleet, wait_for
from tests.fleetctl import fleetctl
from tests.test_deploy_assets import expressions

ROOT = Path(__file__).resolve().parents[2]
RULES = sorted((ROOT / "deploy/prometheus/rules").glob("*.yml"))
RULE_TESTS = sorted((ROOT / "deploy/prometheus/rules/tests").glob("*.yml"))
RATE_INTERVAL = "5s"  # about what Grafana's $__rate_interval is at a 1 s scrape (4 x scrape)
NAME = "web"
REGIONS = ["local-east", "local-west"]
PROMPT = "zebra-canary-prompt-7f3a please summarise my secret plans"
SIM = {"cold_start": 0.2, "max_num_seqs": 16}
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip

pytestmark = pytest.mark.slow

# Metrics that only a component a sim fleet lacks exports (the real engine, the kubernetes
# runtime) or that this fleet does not produce, with the reason: their panels' queries must
# evaluate, not return series.
SIM_CANNOT_EXPORT: dict[str, str] = {
    "fleet_engine_api_requests_total": "per-feature API counts come from the real engine server",
    "fleet_engine_grammar_compile_seconds": "sim replicas do no constrained decoding",
    "fleet_engine_grammar_mask_seconds": "sim replicas do no constrained decoding",
    "fleet_engine_lora_load_seconds": "sim replicas load no LoRA adapters",
    "fleet_engine_lora_adapters": "sim replicas load no LoRA adapters",
    "fleet_engine_spec_decode_": "sim replicas do no speculative decoding",
    "fleet_autoscale_": "this fleet's deployments have fixed counts: no autoscale decisions "
    "(tests/control_plane/autoscale/test_exported.py reads them from the autoscale loop)",
    "fleet_pipeline_": "this fleet runs no pipeline (tests/e2e/test_pipeline.py reads both pipeline "
    "metrics from its two clusters' gateways)",
    "fleet_batch_": "this fleet runs no batch and no async request (tests/e2e/test_batch.py reads every "
    "line, queue-time and batch-status series from its gateway, tests/e2e/test_async_webhook.py the "
    "webhook deliveries)",
}


def sim_cannot_export(expr: str) -> bool:
    return any(metric in expr for metric in SIM_CANNOT_EXPORT)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("observed-home")
    fleet = SimFleet(home, REGIONS, slots=6, gateway={r: {"queue_timeout_s": 2} for r in REGIONS})
    try:
        fleet.up()
        fleet.deploy(NAME, 2, min_regions=2, engine_args=SIM)
        fleet.deploy("api", 2, regions=["local-east"], engine_args={**SIM, "error_rate": 0.2})
        fleet.deploy("stuck", 1, regions=["local-west"], engine_args={"cold_start": 3600})
        fleet.wait_ready(NAME, 2)
        fleet.wait_ready("api", 2)
        wait_for(lambda: fleet.deployment("stuck")["placements"], 60, 0.2, "stuck's replica placed")
        yield fleet
    finally:
        fleet.down()


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


@pytest.fixture
def prometheus_binary() -> str:
    return require_tool("prometheus")  # skips (fails in CI) before the fleet comes up


def test_every_dashboard_query_returns_series(prometheus_binary, fleet: SimFleet, tmp_path):
    # the targets file, as `fleetctl up`/`ps` write it, linked where prometheus.yml looks
    targets_file = fleet.home / "local" / TARGETS_FILE

    def listed():
        fleetctl(fleet.home, "ps")
        groups = json.loads(targets_file.read_text())
        kinds = sorted(g["labels"]["kind"] for g in groups)
        return (
            kinds
            == ["control-plane", "gateway", "gateway", "replica", "replica", "replica", "replica", "replica"]
            and groups
        )

    groups = wait_for(listed, 30, 0.5, "every replica in the targets file")
    targets_dir = tmp_path / "targets"
    targets_dir.mkdir()
    (targets_dir / TARGETS_FILE).symlink_to(targets_file)
    prom = Prometheus(tmp_path, targets_dir, ca_file=fleet.home / "pki" / "ca.pem").start()
    limited = fleet.api(
        "POST",
        "/v1/keys",
        json={"name": "limited", "scopes": ["inference"], "quotas": {"requests_per_minute": 2}},
    ).json()["key"]
    # a team budget, so the budget panel's gauges have series
    budget = fleet.api("PUT", "/v1/budgets/observed", json={"monthly_dollars": 100})
    assert budget.status_code == 200, budget.text
    gateways = [fleet.gateways["local-east"], fleet.gateways["local-west"]]  # west forwards to east
    load = Load(gateways, fleet.key, "api", workers=2, pause_s=0.05).start()
    stop = threading.Event()
    streamer = threading.Thread(target=streams, args=(gateways, fleet.key, "api", stop), daemon=True)
    streamer.start()
    threads = [streamer]
    try:

        def all_up():
            up = [t for t in prom.targets() if t["labels"].get("job") == "fleet" and t["health"] == "up"]
            return len(up) == len(groups) and up

        wait_for(all_up, 60, 0.5, "every fleet target up in Prometheus")

        def rate_limited():  # the 429s of a key over its requests_per_minute
            body = {"model": "api", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            r = httpx.post(f"{gateways[0]}/v1/chat/completions", json=body, timeout=10,
                           headers={"authorization": f"Bearer {limited}"})  # fmt: skip
            return r.status_code == 429

        wait_for(rate_limited, 30, 0.3, "a 429 from the limited key's quota")

        def queued():  # waits for the replica that never comes, then 503
            body = {"model": "stuck", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            with httpx.Client(timeout=30, headers={"authorization": f"Bearer {fleet.key}"}) as client:
                while not stop.is_set():
                    for url in gateways:
                        try:
                            client.post(f"{url}/v1/chat/completions", json=body)
                        except httpx.HTTPError:
                            pass

        waiter = threading.Thread(target=queued, daemon=True)
        waiter.start()
        threads.append(waiter)

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
        for expr in queries:  # every query parses and evaluates, whatever it finds
            prom.query(expr)
        pending = {*(q for q in queries if not sim_cannot_export(q)), *rules}
        answered: dict[str, float] = {}  # expr -> seconds until it first returned series
        started = time.monotonic()

        def every_query_answers():
            for expr in sorted(pending):
                if prom.query(expr):
                    pending.discard(expr)
                    answered[expr] = time.monotonic() - started
            return not pending

        try:
            wait_for(
                every_query_answers, 90, 1.0, "every dashboard query and recording rule to return series"
            )
        except AssertionError:
            raise AssertionError(
                f"no series for: {json.dumps(sorted(pending), indent=1)}\n{prom.log_tail()}"
            ) from None
        slowest = sorted(answered.items(), key=lambda kv: -kv[1])[:3]
        print(f"\n[prometheus] {len(queries)} dashboard queries and {len(rules)} recording rules return series "
              f"within {time.monotonic() - started:.1f}s of the first query; slowest: "
              + "; ".join(f"{t:.1f}s {e[:70]}" for e, t in slowest))  # fmt: skip
        # the numbers behind them are the fleet's: two ready replicas, both clusters healthy
        (ready,) = prom.query('fleet_control_plane_ready_replicas{deployment="api"}')
        assert float(ready["value"][1]) == 2
        healthy = prom.query('fleet_control_plane_clusters{status="healthy"}')
        assert float(healthy[0]["value"][1]) == 2
        forwarded = prom.query('sum(fleet_gateway_forwarded_total{cluster="local-west",deployment="api"})')
        assert forwarded and float(forwarded[0]["value"][1]) > 0, "west forwards api's requests to east"
        alerts = prom.client.get(f"{prom.url}/api/v1/rules").json()["data"]["groups"]
        assert sum(len(g["rules"]) for g in alerts) >= 15 and all(
            r["health"] == "ok" for g in alerts for r in g["rules"]
        ), alerts
    finally:
        stop.set()
        load.stop()
        for thread in threads:
            thread.join(35)
        prom.stop()


@pytest.fixture(scope="module")
def browser():
    sync_playwright = require_playwright()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = os.environ.get("FLEET_CONSOLE_SCREENSHOTS")
    return Shots(Path(folder) if folder else tmp_path_factory.mktemp("console-shots"))


def login(browser, fleet: SimFleet, token: str):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = watched(context)
    page.goto(f"{fleet.api_url}/console/")
    assert "/console/login" in page.url
    page.get_by_label("Token").fill(token)  # the field has a label, and Enter submits (keyboard only)
    page.keyboard.press("Enter")
    page.wait_for_url(f"{fleet.api_url}/console/")  # exactly: the login page's URL ends in /console/ too
    return context, page


def start_rollout(fleet: SimFleet, step_s: float = 4, **engine_args) -> dict:
    body = {"spec": {"engine_args": {**SIM, **engine_args}}, "steps": [10, 50, 100], "step_duration_s": step_s,
            "min_requests": 10, "max_error_rate": 0.05}  # fmt: skip
    r = fleet.api("POST", f"/v1/deployments/{NAME}/rollouts", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def current(fleet: SimFleet) -> dict:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


def test_console_in_a_browser(browser, fleet: SimFleet, shots: Shots):
    read_key = fleet.api("POST", "/v1/keys", json={"name": "viewer", "scopes": ["read"]}).json()["key"]
    quotas = {"requests_per_minute": 100_000, "tokens_per_minute": 1_000_000, "tokens_per_day": 50_000_000}
    app_key = fleet.api("POST", "/v1/keys", json={"name": "app", "scopes": ["inference"], "quotas": quotas})
    app_key = app_key.json()["key"]
    for gateway in fleet.gateways.values():  # keys reach the gateways over NATS
        wait_for(lambda g=gateway: httpx.post(f"{g}/v1/chat/completions", timeout=10,
                 headers={"authorization": f"Bearer {app_key}"},
                 json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                 ).status_code == 200, 20, 0.2, f"the app key at {gateway}")  # fmt: skip
    load = Load([fleet.gateways["local-east"], fleet.gateways["local-west"]], app_key, NAME, workers=4,
                prompt=PROMPT).start()  # fmt: skip
    try:
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = watched(context)
        page.goto(f"{fleet.api_url}/console/deployments/{NAME}")
        assert "/console/login" in page.url
        shots.take(page, "login")
        context.close()

        admin, page = login(browser, fleet, fleet.token)
        (cookie,) = [c for c in admin.cookies() if c["name"] == "fleet_console"]
        assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
        assert fleet.token not in cookie["value"]
        for cluster in ("local-east", "local-west"):
            page.locator(f'svg a.marker.healthy[data-cluster="{cluster}"]').wait_for()
        shots.take(page, "overview")

        page.get_by_role("link", name=NAME, exact=True).click()
        replicas = page.locator("#replicas tbody tr[data-replica]")
        wait_for(lambda: replicas.count() == 2, 20, 0.3, "two replica rows")
        clusters = {replicas.nth(i).locator("td").nth(2).inner_text() for i in range(replicas.count())}
        assert clusters == {"local-east", "local-west"}, clusters
        page.locator("figure.chart .uplot").first.wait_for(timeout=30_000)  # usage arrived, charts drawn
        wait_for(lambda: page.locator("figure.chart .uplot").count() == 4, 30, 0.5, "all four charts")
        shots.take(page, "deployment")

        # a good canary progresses; the admin promotes it from the page at step 2
        start_rollout(fleet, step_s=6, seed=2)  # long enough at 50% to click before it promotes itself
        page.goto(f"{fleet.api_url}/console/deployments/{NAME}/rollout")
        seen = watch(page, lambda phase: page.locator(".steps li.now").all_inner_texts() == ["50%"],
                     60, "the canary at step 2 (50%)")  # fmt: skip
        assert ("observing", "10%") in seen or ("deploying", "50%") in seen, seen
        shots.take(page, "rollout-progress")
        page.get_by_role("button", name="Promote v2").focus()  # operable from the keyboard
        with page.expect_navigation():  # the form posts, then redirects back to the rollout page
            page.keyboard.press("Enter")
        watch(page, lambda phase: phase == "promoted", 20, "promoted")
        promoted = current(fleet)
        assert promoted["phase"] == "promoted" and fleet.deployment(NAME)["current_version"] == 2
        assert "promoted by admin" in promoted["reason"], promoted  # by us, not by finishing its steps

        # a bad canary rolls back by itself; its error-rate line crosses the guard line
        start_rollout(fleet, error_rate=0.4)
        page.goto(f"{fleet.api_url}/console/deployments/{NAME}/rollout")
        watch(page, lambda phase: phase == "rolled_back", 60, "the automatic rollback")
        assert "error rate" in page.locator("#reason").inner_text()

        def crossed():
            body = page.evaluate("document.querySelector('figure.chart[data-key=errors]')._body")
            series = (body or {}).get("errors", {}).get("series", {})
            guard = series.get("guard: max error rate", [])
            return any(c is not None and c > g for c, g in zip(series.get("canary", []), guard))

        wait_for(crossed, 20, 0.5, "the canary's error rate above the guard line in the chart")
        page.locator("figure.chart[data-key=errors] .uplot").wait_for()
        time.sleep(3.5)  # one more chart refresh: the screenshot shows the crossing
        shots.take(page, "rollout-rolled-back")

        # a read token sees the rollout but cannot change it
        start_rollout(fleet, seed=3)
        viewer, vpage = login(browser, fleet, read_key)
        vpage.goto(f"{fleet.api_url}/console/deployments/{NAME}/rollout")
        vpage.locator("#phase").wait_for()
        assert vpage.get_by_role("button", name="Promote v4").count() == 0
        assert "Read-only token" in vpage.content()
        shots.take(vpage, "rollout-read-only")
        csrf = vpage.evaluate("JSON.parse(document.body.getAttribute('hx-headers'))['x-csrf-token']")
        forged = vpage.request.post(
            f"{fleet.api_url}/console/deployments/{NAME}/rollout/promote", form={"csrf_token": csrf}
        )
        assert forged.status == 403 and "read-only" in forged.text()
        assert current(fleet)["active"], "the read token changed nothing"
        viewer.close()

        # the admin aborts it
        page.goto(f"{fleet.api_url}/console/deployments/{NAME}/rollout")
        page.get_by_role("button", name="Abort, back to v2").click()
        watch(page, lambda phase: phase == "aborted", 20, "aborted")
        assert current(fleet)["phase"] == "aborted"

        page.goto(f"{fleet.api_url}/console/keys")
        wait_for(lambda: page.locator("#usage tbody td").first.inner_text() != "No usage in this period.", 5, 0.5,
                 "usage rows")  # fmt: skip
        assert "requests_per_minute" in page.locator("#keys").inner_text()
        shots.take(page, "keys")
        page.goto(f"{fleet.api_url}/console/events?kind=rollout_rolled_back")
        assert "canary_error_rate=" in page.locator("#events").inner_text()
        page.goto(f"{fleet.api_url}/console/events?deployment={NAME}")
        shots.take(page, "events", full_page=False)
        page.goto(f"{fleet.api_url}/console/audit?action=rollout.abort")
        assert "rollout.abort" in page.locator("#audit tbody").inner_text()
        page.goto(f"{fleet.api_url}/console/audit")
        shots.take(page, "audit", full_page=False)
        admin.close()
    finally:
        load.stop()
    assert len(load.results) > 50
    # the forged POST's 403 is the one error a page may log
    assert [e for e in BROWSER_ERRORS if "403" not in e] == [], BROWSER_ERRORS
    for where, html in shots.pages.items():
        for secret in (fleet.token, read_key, fleet.key, app_key, PROMPT, "zebra-canary"):
            assert secret not in html, f"{where} shows a secret or the prompt"
