"""The operator console in a real browser: Debian's Chromium, driven by Playwright, against
a local sim fleet of real processes (nats-server, control plane, two agents + gateways,
simulated replicas) under steady load.

One story, in order: log in with the admin token; both clusters on the map and the
deployment's replicas in both; a good canary progresses step by step and is promoted
with the admin token; a bad canary rolls back by itself while its error-rate chart
crosses the guard line; a read token sees no buttons and a forged promote with its own
CSRF token is refused; the admin aborts; keys, events and audit pages. No page ever holds
a token or the prompt text. Screenshots of each page go to FLEET_CONSOLE_SCREENSHOTS
(docs/console/ when regenerating the docs), else to the test's temporary folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.observability_tools import CHROMIUM, require_playwright
from tests.e2e.sim_fleet import Load, SimFleet, wait_for

NAME = "web"
PROMPT = "zebra-canary-prompt-7f3a please summarise my secret plans"
SIM = {"cold_start": 0.2, "max_num_seqs": 16}
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_playwright()
    fleet = SimFleet(tmp_path_factory.mktemp("console-home"), ["local-east", "local-west"], slots=6)
    try:
        fleet.up()
        body = {"name": NAME, "model": "sim", "replicas": 2, "min_regions": 2, "engine_args": SIM}
        r = fleet.api("POST", "/v1/deployments", json=body)
        assert r.status_code == 201, r.text
        wait_for(lambda: fleet.ready_by_version(NAME).get(1) == 2, 60, 0.2, "the baseline's replicas")
        yield fleet
    finally:
        fleet.down()


@pytest.fixture(scope="module")
def browser(fleet):
    sync_playwright = require_playwright()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Shots:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.pages: dict[str, str] = {}  # url -> html, every page a test looked at

    def take(self, page, name: str, full_page: bool = True) -> None:
        page.screenshot(path=str(self.folder / f"{name}.png"), full_page=full_page)
        self.pages[f"{name} {page.url}"] = page.content()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = os.environ.get("FLEET_CONSOLE_SCREENSHOTS")
    return Shots(Path(folder) if folder else tmp_path_factory.mktemp("console-shots"))


def login(browser, fleet: SimFleet, token: str):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(f"{fleet.api_url}/console/")
    assert "/console/login" in page.url
    page.get_by_label("Token").fill(token)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/console/")
    return context, page


def start_rollout(fleet: SimFleet, **engine_args) -> dict:
    body = {"spec": {"engine_args": {**SIM, **engine_args}}, "steps": [10, 50, 100], "step_duration_s": 4,
            "min_requests": 10, "max_error_rate": 0.05}  # fmt: skip
    r = fleet.api("POST", f"/v1/deployments/{NAME}/rollouts", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def current(fleet: SimFleet) -> dict:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


def watch(page, until, timeout: float, what: str) -> list[tuple[str, str]]:
    """(phase, step) as the page shows them, polled until `until(phase)`."""
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        phase = page.locator("#phase").inner_text()
        step = page.locator(".steps li.now").all_inner_texts()
        now = (phase, step[0] if step else "")
        if not seen or seen[-1] != now:
            seen.append(now)
        if until(phase):
            return seen
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; saw {seen}")


def test_console_in_a_browser(fleet: SimFleet, browser, shots: Shots):
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
        page = context.new_page()
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
        start_rollout(fleet, seed=2)
        page.goto(f"{fleet.api_url}/console/deployments/{NAME}/rollout")
        seen = watch(page, lambda phase: page.locator(".steps li.now").all_inner_texts() == ["50%"],
                     60, "the canary at step 2 (50%)")  # fmt: skip
        assert ("observing", "10%") in seen or ("deploying", "50%") in seen, seen
        shots.take(page, "rollout-progress")
        page.get_by_role("button", name="Promote v2").click()
        page.wait_for_url(f"**/console/deployments/{NAME}/rollout")
        watch(page, lambda phase: phase == "promoted", 20, "promoted")
        assert current(fleet)["phase"] == "promoted" and fleet.deployment(NAME)["current_version"] == 2

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
    for where, html in shots.pages.items():
        for secret in (fleet.token, read_key, fleet.key, app_key, PROMPT, "zebra-canary"):
            assert secret not in html, f"{where} shows a secret or the prompt"
