"""Cost end to end on a real local fleet (nats-server, control plane, agent, gateway; one
simulated replica on a priced pool) under a little chat traffic: `fleetctl cost` reports the
deployment's tokens and dollars, `fleetctl cost --tco` prices them with the shipped sample
price file, the API refuses bad windows with a reason, /metrics carries the cost gauges and
the console's cost page shows the deployment.
Figures are printed (pytest -s)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.control_plane.test_console import Console
from tests.e2e.sim_fleet import Load, SimFleet, wait_for
from tests.fleetctl import fleetctl, fleetctl_json

ROOT = Path(__file__).resolve().parents[2]
REGION = "local-east"
NAME = "costed"
PRICES = ROOT / "docs" / "examples" / "api-prices.yaml"
SLOTS = 2
WIDE = {"COLUMNS": "160"}  # a captured stdout is 80 columns to rich: the table's cells would be cut
NODE_PRICE = 8.0  # per node-hour: $4 per GPU (slot) hour
ONE = {"input_per_mtok": 1, "output_per_mtok": 1}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = SimFleet(tmp_path_factory.mktemp("cost-home"), [REGION], slots=SLOTS,
                     pool={"hourly_price": NODE_PRICE, "tier": "on-demand"})  # fmt: skip
    try:
        fleet.up()
        fleet.deploy(NAME, 1, engine_args={"cold_start": 0.1})
        fleet.wait_ready(NAME, 1)
        load = Load([fleet.gateways[REGION]], fleet.key, NAME, workers=2, max_tokens=4).start()
        try:
            load.served(20, what="20 requests")
        finally:
            load.stop()
        assert not load.failed(), load.failed()[:3]
        yield fleet
    finally:
        fleet.down()


def deployment_row(report: dict) -> dict | None:
    return next((r for r in report["rows"] if r["group"] == NAME), None)


def test_fleetctl_cost_reports_tokens_and_dollars(fleet):
    def stored():  # usage reaches the control plane through NATS, a moment after the requests
        row = deployment_row(fleet.api("GET", "/v1/cost", params={"since": "1h"}).json())
        return row if row and row["prompt_tokens"] and row["completion_tokens"] >= 20 else None

    wait_for(stored, 20, 0.2, "the usage records")
    report = fleetctl_json(fleet.home, "cost", "--since", "1h")
    row = deployment_row(report)
    assert report["by"] == "deployment" and row is not None, report
    assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0 and row["requests"] >= 20
    assert row["gpu_dollars"] > 0 and row["gpu_hours"] > 0
    assert row["dollars_by_tier"].get("on-demand", 0) > 0
    # non-streamed chat: the replica's x-fleet-ttft-s splits each request, so decode is measured
    assert row["decode_s"] > 0 and row["dollars_per_mtok"]["decode"] > 0
    assert report["total"]["gpu_dollars"] >= row["gpu_dollars"]
    table = fleetctl(fleet.home, "cost", "--since", "1h", env=WIDE).stdout
    print(f"\n$ fleetctl cost --since 1h\n{table}")
    assert NAME in table and "total" in table and "$/Mtok" in table


def test_fleetctl_cost_tco_with_the_sample_prices(fleet):
    result = fleetctl(fleet.home, "cost", "--tco", "--prices", str(PRICES), "--since", "1h", env=WIDE)
    print(f"\n$ fleetctl cost --tco --prices docs/examples/api-prices.yaml --since 1h\n{result.stdout}")
    assert NAME in result.stdout and "break-even" in result.stdout
    assert "a week or more" in result.stdout  # an hour's window is flagged
    r = fleet.api("POST", "/v1/cost/tco", json={"prices": PRICES.read_text(), "since": "1h"})
    assert r.status_code == 200, r.text
    tco = r.json()
    (row,) = [x for x in tco["rows"] if x["deployment"] == NAME]
    assert row["priced_as"] == "default" and row["api_dollars"] > 0 and row["gpu_dollars"] > 0
    assert tco["engineering_dollars"] > 0 and tco["fleet_dollars"] > tco["gpu_dollars"]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "field"),
    [
        ("GET", "/v1/cost", {"params": {"since": "yesterday"}}, "since"),
        ("GET", "/v1/cost", {"params": {"since": "2999-01-01T00:00:00"}}, "since"),
        ("GET", "/v1/cost", {"params": {"by": "region"}}, "by"),
        ("POST", "/v1/cost/tco", {"json": {"prices": "default: {input_per_mtok: -1}"}}, "prices"),
        ("POST", "/v1/cost/tco", {"json": {"prices": "[1, 2]"}}, "prices"),
        ("POST", "/v1/cost/tco", {"json": {"prices": {"default": {}}}}, "prices"),
        ("POST", "/v1/cost/tco", {"json": {"prices": {"default": ONE}, "since": "7x"}}, "since"),
    ],
)
def test_bad_windows_and_price_files_are_422_with_a_reason(fleet, method, path, kwargs, field):
    r = fleet.api(method, path, **kwargs)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field and error["message"], error


def test_cost_gauges_on_metrics(fleet):
    text = httpx.get(f"{fleet.api_url}/metrics", timeout=10).text
    hourly = re.search(rf'^fleet_cost_hourly_dollars\{{deployment="{NAME}"\}} (\S+)$', text, re.M)
    assert hourly and float(hourly.group(1)) == pytest.approx(NODE_PRICE / SLOTS), text[-2000:]
    for phase in ("prefill", "decode", "total"):
        line = rf'^fleet_cost_per_million_tokens\{{deployment="{NAME}",phase="{phase}"\}} (\S+)$'
        found = re.search(line, text, re.M)
        assert found and float(found.group(1)) >= 0, phase
        if phase == "total":
            assert float(found.group(1)) > 0


def test_console_cost_page_shows_the_deployment(fleet):
    console = Console(SimpleNamespace(url=fleet.api_url), fleet.token)
    page = console.get("/console/cost?since=1h")
    assert page.status_code == 200 and f"<td>{NAME}</td>" in page.text
    chart = console.get("/console/cost/series.json?since=1h").json()["hourly"]
    assert max(v or 0 for v in chart["series"][NAME]) > 0 and chart["series"]["total"]
