"""deploy/: the Grafana dashboard only queries metrics docs/metrics.md documents, uses
histograms through their `_bucket` series with `le`, and every config file parses."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from control_plane.api.metrics import AUTOSCALE_GAUGES, PREDICTION_ERROR_GAUGES
from control_plane.local.nats_server import nats_server_binary
from control_plane.local.prometheus_sd import TARGETS_FILE

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fleet.json"
METRIC = re.compile(r"\b(fleet_[a-z0-9_]+)\b")
ROW = re.compile(r"^\|\s*`(fleet_[a-z0-9_]+)(?:\{[^}]*\})?`\s*\|(.*)$")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def documented() -> dict[str, str]:
    """{metric name: type} from docs/metrics.md's tables: a `type` column, or the engine's
    `## Histograms` / `## Gauges` / `## Counters` sections."""
    out: dict[str, str] = {}
    section = ""
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("#"):
            section = line.lower()
        m = ROW.match(line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        if cells and cells[0] in ("counter", "gauge", "histogram"):
            out[m.group(1)] = cells[0]
        else:
            out[m.group(1)] = next(
                (k for k in ("histogram", "gauge", "counter") if f"## {k}" in section), "unknown"
            )
    return out


def panels(node) -> list[dict]:
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found.extend(panels(panel))
    return found


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def test_metric_docs_parse():
    docs = documented()
    assert docs["fleet_engine_time_to_first_token_seconds"] == "histogram"
    assert docs["fleet_engine_kv_cache_usage_ratio"] == "gauge"
    assert docs["fleet_gateway_requests_total"] == "counter"
    assert docs["fleet_control_plane_reconcile_duration_seconds"] == "histogram"
    assert "unknown" not in docs.values(), docs


def test_dashboard_metrics_are_documented_and_histograms_used_right():
    docs = documented()
    exprs = expressions()
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        names = METRIC.findall(expr)
        assert names, f"no fleet metric in {expr!r}"
        for name in names:
            base = name
            if name.endswith(HISTOGRAM_SUFFIXES):
                stem = name.rsplit("_", 1)[0]
                if docs.get(stem) == "histogram":
                    base = stem
            assert base in docs, f"{name} (in {expr!r}) is not documented in docs/metrics.md"
            if docs[base] == "histogram":
                assert name != base, f"histogram {base} used without _bucket/_sum/_count: {expr!r}"
                if name.endswith("_bucket"):
                    assert "histogram_quantile(" in expr, expr
                    assert re.search(r"by \(le\b", expr), f"_bucket aggregated without le: {expr!r}"
            else:
                assert not name.endswith("_bucket"), f"{name} is not a histogram: {expr!r}"
            used.add(base)
    # the panels the dashboard promises
    for name in (
        "fleet_gateway_requests_total",
        "fleet_gateway_time_to_first_token_seconds",
        "fleet_gateway_request_duration_seconds",
        "fleet_gateway_tokens_total",
        "fleet_gateway_queue_class_depth",
        "fleet_gateway_rate_limited_total",
        "fleet_gateway_retries_total",
        "fleet_gateway_forwarded_total",
        "fleet_engine_kv_cache_usage_ratio",
        "fleet_engine_requests_running",
        "fleet_engine_requests_waiting",
        "fleet_agent_cold_start_seconds",
        "fleet_control_plane_desired_replicas",
        "fleet_control_plane_ready_replicas",
        "fleet_control_plane_clusters",
    ):
        assert name in used, name


def test_node_health_row_shows_the_agents_and_the_record():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"] == "Node health"]
    assert len(rows) == 1
    y = rows[0]["gridPos"]["y"]
    below = [p for p in dashboard["panels"] if p["type"] != "row" and y < p["gridPos"]["y"] <= y + 9]
    used = {name for p in below for t in p["targets"] for name in METRIC.findall(t["expr"])}
    assert used >= {
        "fleet_agent_node_state",
        "fleet_agent_gpu_errors_total",
        "fleet_nodes",
        "fleet_node_faults_total",
        "fleet_pool_reliability_premium_dollars",
    }


def test_autoscaler_row_shows_predictions_their_error_and_the_plan():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"] == "Autoscaler predictions"]
    assert len(rows) == 1
    y = rows[0]["gridPos"]["y"]
    below = [p for p in dashboard["panels"] if p["type"] != "row" and y < p["gridPos"]["y"] <= y + 17]
    used = {name for p in below for t in p["targets"] for name in METRIC.findall(t["expr"])}
    assert used >= {
        "fleet_autoscale_prediction_predicted",
        "fleet_autoscale_prediction_observed",
        "fleet_autoscale_prediction_mape",
        "fleet_autoscale_prediction_error_ratio",
        "fleet_autoscale_burst_held_replicas",
        "fleet_autoscale_cold_start_seconds",
        "fleet_autoscale_scale_down_delay_seconds",
        "fleet_autoscale_burst_hold_seconds",
    }
    exported = {"fleet_autoscale_" + name for name, _ in PREDICTION_ERROR_GAUGES}
    exported |= {"fleet_autoscale_" + name for name, _, _ in AUTOSCALE_GAUGES}
    assert {n for n in used if n.startswith("fleet_autoscale_")} <= exported  # the names /metrics serves


def test_batch_row_shows_the_queue_the_lines_and_the_webhooks():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"] == "Batch and async"]
    assert len(rows) == 1
    y = rows[0]["gridPos"]["y"]
    below = [p for p in dashboard["panels"] if p["type"] != "row" and y < p["gridPos"]["y"] <= y + 17]
    exprs = [t["expr"] for p in below for t in p["targets"]]
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used >= {
        "fleet_batch_lines_queued",
        "fleet_batch_lines_in_flight",
        "fleet_batch_lines_completed_total",
        "fleet_batch_lines_failed_total",
        "fleet_batch_lines_retried_total",
        "fleet_batch_queue_seconds_bucket",
        "fleet_batch_webhook_deliveries_total",
    }
    assert any(
        e.startswith("histogram_quantile(0.99,") and "fleet_batch_queue_seconds_bucket" in e for e in exprs
    )
    assert any("by (outcome)" in e and "fleet_batch_webhook_deliveries_total" in e for e in exprs)
    # every gateway reports the same store's backlog and batches: max, never a sum over gateways
    for shared in ("fleet_batch_lines_queued", "fleet_batch_batches"):
        assert all(e.startswith("max by (") for e in exprs if shared in e), shared


def test_dashboard_shape_and_provisioning_agree():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for p in panels(dashboard):
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) >= {"datasource", "deployment"}

    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/fleet.yaml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] == variables["datasource"]["current"]["value"]
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fleet.yaml").read_text())
    assert providers["providers"][0]["options"]["path"]


def test_prometheus_config_scrapes_the_file_sd_targets():
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    (sd,) = jobs["fleet"]["file_sd_configs"]
    (pattern,) = sd["files"]
    assert (DEPLOY / "prometheus/targets").is_dir()
    # the glob finds the file `fleetctl up` writes, also with $FLEET_HOME/local mounted as
    # targets/, and not the fleet's own state file next to it
    assert fnmatch.fnmatch(f"targets/{TARGETS_FILE}", pattern)
    assert not fnmatch.fnmatch("targets/fleet.json", pattern)
    assert TARGETS_FILE in (DEPLOY / "README.md").read_text()


def test_nats_config_is_valid():
    try:
        binary = nats_server_binary()
    except FileNotFoundError:
        pytest.skip("nats-server not installed")
    conf = DEPLOY / "nats/nats-server.conf"
    proc = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^jetstream\s*\{", conf.read_text(), re.M)


def test_slo_rules_use_documented_metrics():
    """Every metric the SLO rules read is in docs/metrics.md; alerts read the recording rules."""
    docs = documented()
    rules = [r for f in sorted((DEPLOY / "prometheus/rules").glob("*.yml"))
             for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]  # fmt: skip
    recorded = {r["record"] for r in rules if "record" in r}
    assert {"alert" in r for r in rules} == {True, False} and len(recorded) >= 8
    for rule in rules:
        expr = re.sub(r"[a-z_]+:[a-z0-9_:]+", " ", rule["expr"])  # recording-rule names aside
        for name in METRIC.findall(expr):
            stem = name.rsplit("_", 1)[0] if name.endswith(HISTOGRAM_SUFFIXES) else name
            assert name in docs or stem in docs, f"{name} in {rule} is not documented in docs/metrics.md"
        for ref in re.findall(r"[a-z_]+:[a-z0-9_:]+", rule["expr"]):
            assert ref in recorded, f"{ref} in {rule} is not a recording rule"
    for name in recorded:
        level, metric, _ = name.split(":")
        assert level and METRIC.fullmatch(metric), name
