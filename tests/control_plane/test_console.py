"""The console's security on a real control plane process (SQLite, no loops, so a rollout
stays where the API put it): no session -> login page; cookie flags; CSRF on every form;
a read token changes nothing; a revoked key ends its session; no token or secret in any
page; every page and fragment renders. Plus the map and chart helpers.

Cookies are handled by hand: the session cookie is `Secure`, and a plain-HTTP client
rightly refuses to send those back itself (browsers make an exception for 127.0.0.1)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest

from control_plane.console import series, worldmap
from control_plane.db import models as m
from control_plane.db.session import make_sessions
from control_plane.rollouts.telemetry import Sample
from tests.control_plane.cp_server import ControlPlaneServer, fresh_database

NAME = "web"
PIPELINE = "rag"


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    url, cleanup = fresh_database("sqlite", tmp)
    server = ControlPlaneServer(tmp / "home", url)
    try:
        server.start()
        with server.client() as admin:
            pools = [{"name": "h100", "gpu_model": "H100", "gpus_per_node": 8, "nodes": 2, "tier": "spot",
                      "hourly_price": 24.0}]  # fmt: skip
            for cid, region, lat, lon in (("aws-us-east-1", "us-east-1", 38.95, -77.45),
                                          ("gcp-europe-west4", "europe-west4", 53.44, 6.84)):  # fmt: skip
                r = admin.post("/v1/clusters", json={"id": cid, "provider": cid.split("-")[0], "region": region,
                                                     "lat": lat, "lon": lon, "pools": pools})  # fmt: skip
                assert r.status_code == 201, r.text
            assert (
                admin.post("/v1/deployments", json={"name": NAME, "model": "m", "replicas": 1}).status_code
                == 201
            )
            steps = [{"name": "answer", "deployment": NAME}]
            r = admin.post("/v1/pipelines", json={"name": PIPELINE, "steps": steps, "slo_e2e_s": 0.8})
            assert r.status_code == 201, r.text
            server.read_key = admin.post("/v1/keys", json={"name": "viewer", "scopes": ["read"]}).json()[
                "key"
            ]
            server.inference_key = admin.post(
                "/v1/keys", json={"name": "app", "scopes": ["inference"]}
            ).json()["key"]
            r = admin.post(f"/v1/deployments/{NAME}/rollouts", json={"spec": {"engine_args": {"seed": 1}}})
            assert r.status_code == 201, r.text
        yield server
    finally:
        server.kill()
        cleanup()


class Forms(HTMLParser):
    """Every <form method=post> of a page with its hidden fields."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form" and (a.get("method") or "get").lower() == "post":
            self.forms.append({"action": a.get("action"), "fields": {}})
        elif tag == "input" and self.forms and a.get("type") == "hidden":
            self.forms[-1]["fields"][a.get("name")] = a.get("value")


def forms_of(html: str) -> list[dict]:
    parser = Forms()
    parser.feed(html)
    return parser.forms


def cookie(response: httpx.Response, name: str) -> str | None:
    for header in response.headers.get_list("set-cookie"):
        if header.startswith(f"{name}="):
            return header
    return None


class Console:
    """A logged-in console client: its session cookie and CSRF token."""

    def __init__(self, cp: ControlPlaneServer, token: str) -> None:
        self.client = httpx.Client(base_url=cp.url, timeout=30)
        form = self.client.get("/console/login")
        login = re.search(r"fleet_console_login=([^;]+)", cookie(form, "fleet_console_login")).group(1)
        self.response = self.client.post(
            "/console/login",
            data={"token": token, "csrf_token": login},
            headers={"cookie": f"fleet_console_login={login}"},
        )
        assert self.response.status_code == 303, self.response.text
        self.session = re.search(r"fleet_console=([^;]+)", cookie(self.response, "fleet_console")).group(1)
        page = self.get("/console/")
        self.csrf = re.search(r'"x-csrf-token": "([^"]+)"', page.text).group(1)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.client.get(path, headers={"cookie": f"fleet_console={self.session}"}, **kw)

    def post(self, path: str, data: dict | None = None, headers: dict | None = None) -> httpx.Response:
        return self.client.post(
            path, data=data or {}, headers={"cookie": f"fleet_console={self.session}", **(headers or {})}
        )


PAGES = [
    "/console/", "/console/panel/overview", f"/console/deployments/{NAME}", f"/console/deployments/{NAME}/panel",
    f"/console/deployments/{NAME}/series.json", f"/console/deployments/{NAME}/rollout",
    f"/console/deployments/{NAME}/rollout/panel", f"/console/deployments/{NAME}/rollout/series.json",
    "/console/keys", "/console/events", "/console/events?kind=rollout_started&fragment=1", "/console/audit",
    "/console/audit?action=key.create&fragment=1", "/console/land.svg", "/console/cost",
    "/console/cost?since=1h", "/console/cost/series.json", "/console/nodes",
    f"/console/deployments/{NAME}/autoscale.json", "/console/panel/control-plane",
    "/console/pipelines", f"/console/pipelines/{PIPELINE}", f"/console/pipelines/{PIPELINE}/panel",
    "/console/batches", "/console/batches/panel",
]  # fmt: skip


def phase(cp) -> str:
    with cp.client() as admin:
        return admin.get(f"/v1/deployments/{NAME}/rollouts/current").json()["phase"]


def test_no_session_gets_the_login_page(cp):
    with httpx.Client(base_url=cp.url, timeout=30) as anon:
        for path in PAGES:
            r = anon.get(path)
            if path.endswith((".json", "/panel")) or "fragment" in path or "panel/" in path:
                assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/login", path
            elif path.endswith(".svg"):
                assert r.status_code in (303, 401), path
            else:
                assert r.status_code == 303 and r.headers["location"].startswith("/console/login"), path
        login = anon.get("/console/login")
        assert login.status_code == 200 and 'name="token"' in login.text and 'type="password"' in login.text
        # a bogus cookie is no session; the bearer token of the API is not a console login
        assert anon.get("/console/", headers={"cookie": "fleet_console=forged"}).status_code == 303
        assert anon.get("/console/", headers={"authorization": f"Bearer {cp.token}"}).status_code == 303
        for action in ("promote", "abort"):
            assert anon.post(f"/console/deployments/{NAME}/rollout/{action}").status_code == 401
    assert phase(cp) == "deploying"


def test_login_sets_a_secure_session_cookie_not_the_token(cp):
    console = Console(cp, cp.token)
    header = cookie(console.response, "fleet_console")
    for flag in ("HttpOnly", "Secure", "SameSite=strict", "Path=/console"):
        assert flag.lower() in header.lower(), header
    assert cp.token not in header and console.session not in cp.token
    login_form = cookie(console.client.get("/console/login"), "fleet_console_login")
    assert login_form and "httponly" in login_form.lower() and "secure" in login_form.lower()
    page = console.get("/console/")
    assert page.status_code == 200
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"


def test_login_refuses_bad_tokens_and_a_missing_csrf_token(cp):
    with httpx.Client(base_url=cp.url, timeout=30) as c:
        form = c.get("/console/login")
        login = re.search(r"fleet_console_login=([^;]+)", cookie(form, "fleet_console_login")).group(1)
        jar = {"cookie": f"fleet_console_login={login}"}
        r = c.post("/console/login", data={"token": cp.token}, headers=jar)
        assert r.status_code == 403 and cookie(r, "fleet_console") is None  # no CSRF field
        r = c.post("/console/login", data={"token": cp.token, "csrf_token": login})
        assert r.status_code == 403 and cookie(r, "fleet_console") is None  # no double-submit cookie
        r = c.post("/console/login", data={"token": "fleet-nope-nope", "csrf_token": login}, headers=jar)
        assert r.status_code == 401 and "Unknown or revoked" in r.text and cookie(r, "fleet_console") is None
        r = c.post("/console/login", data={"token": cp.inference_key, "csrf_token": login}, headers=jar)
        assert r.status_code == 403 and "admin or read scope" in r.text and cookie(r, "fleet_console") is None
        assert cp.inference_key not in r.text and "fleet-nope-nope" not in r.text


def test_every_form_carries_the_csrf_token_and_needs_it(cp):
    console = Console(cp, cp.token)
    seen = set()
    for path in PAGES:
        r = console.get(path)
        assert r.status_code == 200, (path, r.text[:300])
        for form in forms_of(r.text):
            assert form["fields"].get("csrf_token") == console.csrf, (path, form)
            seen.add(form["action"])
    assert seen == {"/console/logout", f"/console/deployments/{NAME}/rollout/promote",
                    f"/console/deployments/{NAME}/rollout/abort"}, seen  # fmt: skip
    for action in sorted(seen):
        for data in ({}, {"csrf_token": "wrong"}, {"csrf_token": console.csrf[:-1]}):
            r = console.post(action, data)
            assert r.status_code == 403 and "CSRF" in r.text, (action, data)
    assert phase(cp) == "deploying"
    assert console.get("/console/").status_code == 200  # logout without a token did nothing
    r = console.post(f"/console/deployments/{NAME}/rollout/nope", {"csrf_token": console.csrf})
    assert r.status_code == 404


def test_a_read_token_sees_everything_and_changes_nothing(cp):
    console = Console(cp, cp.read_key)
    rollout = console.get(f"/console/deployments/{NAME}/rollout")
    assert rollout.status_code == 200 and "Read-only token" in rollout.text
    assert [f["action"] for f in forms_of(rollout.text)] == ["/console/logout"]
    for action in ("promote", "abort"):
        for send in ({"data": {"csrf_token": console.csrf}}, {"headers": {"x-csrf-token": console.csrf}}):
            r = console.post(f"/console/deployments/{NAME}/rollout/{action}", **send)
            assert r.status_code == 403 and "read-only" in r.text
    assert phase(cp) == "deploying"
    with cp.client() as admin:
        actions = [a["action"] for a in admin.get("/v1/audit").json()["items"]]
    assert not any(a.startswith(("rollout.promote", "rollout.abort")) for a in actions)


def test_an_admin_aborts_through_the_api_route_with_audit(cp):
    console = Console(cp, cp.token)
    r = console.post(f"/console/deployments/{NAME}/rollout/abort", {"csrf_token": console.csrf})
    assert r.status_code == 303 and r.headers["location"] == f"/console/deployments/{NAME}/rollout"
    assert phase(cp) == "aborted"
    with cp.client() as admin:
        (record,) = admin.get("/v1/audit", params={"action": "rollout.abort"}).json()["items"]
    assert record["actor"].startswith("admin")
    again = console.post(f"/console/deployments/{NAME}/rollout/promote", {"csrf_token": console.csrf})
    assert again.status_code == 409 and "no active rollout" in again.text
    page = console.get(f"/console/deployments/{NAME}/rollout")
    assert "aborted" in page.text and len(forms_of(page.text)) == 1  # no buttons on a finished rollout


def test_logout_and_revocation_end_the_session(cp):
    console = Console(cp, cp.token)
    r = console.post("/console/logout", {"csrf_token": console.csrf})
    assert r.status_code == 303 and console.get("/console/").status_code == 303
    with cp.client() as admin:
        made = admin.post("/v1/keys", json={"name": "temp-read", "scopes": ["read"]}).json()
        viewer = Console(cp, made["key"])
        assert viewer.get("/console/keys").status_code == 200
        assert admin.delete(f"/v1/keys/{made['key_id']}").status_code == 200
    assert viewer.get("/console/keys").status_code == 303


def test_no_token_or_secret_in_any_page(cp):
    console = Console(cp, cp.token)
    # The token's random part is everything after "fleet-<id>-" (key_id_of's split): it may
    # itself hold "-", so the part after the last dash could be short or empty.
    secrets = [cp.token, cp.read_key, cp.inference_key, cp.token.split("-", 2)[2]]
    for path in PAGES:
        body = console.get(path).text
        for secret in secrets:
            assert secret not in body, path
    keys = console.get("/console/keys").text
    assert "viewer" in keys and "app" in keys  # the keys are listed, by id and name only


def test_pages_show_the_fleet(cp):
    console = Console(cp, cp.read_key)
    overview = console.get("/console/").text
    for cid in ("aws-us-east-1", "gcp-europe-west4"):
        assert f'data-cluster="{cid}"' in overview
    x, y = worldmap.project(53.44, 6.84)
    assert f'cx="{x}" cy="{y}"' in overview
    assert "spot" in overview and "<meter" in overview
    assert console.get("/console/deployments/nope").status_code == 404
    card = console.get("/console/panel/control-plane").text  # through GET /v1/control-plane's own function
    assert "Leader <strong>none</strong>, epoch <strong>0</strong>" in card  # --no-loops: nobody stands
    land = console.get("/console/land.svg")
    assert land.headers["content-type"].startswith("image/svg+xml") and land.text.count("M") > 100
    for asset in ("vendor/htmx.min.js", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css", "console.js"):
        assert console.client.get(f"/console/static/{asset}").status_code == 200, asset


def test_nodes_page_shows_the_record_and_pools_reliability(cp):
    sessions = make_sessions(cp.database_url)
    node = dict(cluster="aws-us-east-1", node="ip-10-0-0-7")
    with sessions() as s:
        s.add(m.Node(**node, state="cordoned", reason="xid 79 on GPU 3", gpus=8, gpus_withheld=[3],
                     cordoned_by="agent", pool="h100", action_reason="", action_by=""))  # fmt: skip
        s.add(m.NodeFaultRecord(**node, fault_id="console-f1", gpu=3, kind="xid", at=m.utcnow(),
                                evidence="XID 79", pool="h100", provider="aws"))  # fmt: skip
        s.commit()
    sessions.kw["bind"].dispose()
    page = Console(cp, cp.read_key).get("/console/nodes")
    assert page.status_code == 200
    row = page.text.split('data-node="aws-us-east-1/ip-10-0-0-7"')[1].split("</tr>")[0]
    for cell in ("cordoned", "xid 79 on GPU 3", "<td>1</td>", "1 withheld", "agent"):
        assert cell in row, cell
    pools = page.text.split('id="reliability"')[1]
    assert "h100" in pools and "gcp-europe-west4" in pools


def test_batches_page_says_why_it_cannot_read_them_without_nats(cp):
    """This control plane's NATS is unreachable: the page renders, saying so (the API's
    503 reason), with empty tables; tests/control_plane/test_batches_api.py fills them."""
    console = Console(cp, cp.read_key)
    page = console.get("/console/batches")
    assert page.status_code == 200
    down = page.text.split('id="batches-down"')[1].split("</p>")[0]
    assert "NATS is unreachable" in down
    assert 'href="/console/batches" aria-current="page"' in page.text
    assert "No batches" in page.text and "No async requests" in page.text


def test_pipeline_pages_show_steps_and_readiness_per_cluster(cp):
    sessions = make_sessions(cp.database_url)
    with sessions() as s:
        dep = s.query(m.Deployment).filter_by(name=NAME).one()
        s.add(m.ReplicaAssignment(replica_id="pl-web-1", deployment_id=dep.id, version=1,
                                  cluster_id="gcp-europe-west4", state="ready"))  # fmt: skip
        s.commit()
    sessions.kw["bind"].dispose()
    console = Console(cp, cp.read_key)
    listing = console.get("/console/pipelines").text
    row = listing.split(f'data-pipeline="{PIPELINE}"')[1].split("</tr>")[0]
    for cell in (f'href="/console/pipelines/{PIPELINE}"', f"answer (<a href=\"/console/deployments/{NAME}\">", "800 ms",
                 '<span class="badge ready">gcp-europe-west4</span>'):  # fmt: skip
        assert cell in row, cell
    page = console.get(f"/console/pipelines/{PIPELINE}").text
    assert f"Pipeline {PIPELINE}" in page and 'data-step="answer"' in page
    clusters = page.split('id="clusters"')[1]
    west = clusters.split('data-cluster="gcp-europe-west4"')[1].split("</tr>")[0]
    east = clusters.split('data-cluster="aws-us-east-1"')[1].split("</tr>")[0]
    assert "badge ready" in west and "<td>1</td>" in west
    assert "not ready" in east and "<td>0</td>" in east
    assert console.get("/console/pipelines/nope").status_code == 404


def test_map_projection_and_antimeridian():
    assert worldmap.project(0, -180) == (0.0, round(84 / 142 * worldmap.HEIGHT, 1))
    assert worldmap.project(84, 180) == (worldmap.WIDTH, 0.0)
    topology = {"arcs": [[[170, 10], [20, 0], [0, 5]]], "objects": {"o": {"type": "Polygon", "arcs": [[0]]}}}
    # no transform: absolute positions; the 170 -> 190 (-170 wrapped is beyond) step is a move
    wrapped = {
        "arcs": [[[170, 10], [-170, 10], [-170, 15]]],
        "objects": {"o": {"type": "Polygon", "arcs": [[0]]}},
    }
    assert worldmap.svg_path(topology, "o").count("L") == 2
    assert worldmap.svg_path(wrapped, "o").count("M") == 2


def test_guard_series_marks_the_crossing():
    now = 1_000_000.0
    samples = [Sample(now + i * 0.5, 1, False, 0.2) for i in range(40)]
    samples += [Sample(now + 10 + i * 0.5, 2, i % 2 == 0, 0.5) for i in range(20)]
    body = series.guard_series(samples, 1, 2, now - 30, now + 20, 0.05, 1.3)
    errors, ttft = body["errors"]["series"], body["ttft"]["series"]
    assert len(body["errors"]["x"]) == len(errors["canary"]) == len(errors["guard: max error rate"])
    assert max(v for v in errors["canary"] if v is not None) > 0.05
    assert all(v in (None, 0.0) for v in errors["baseline"])
    assert max(v for v in ttft["canary p90"] if v is not None) > max(
        v for v in ttft["guard: baseline p90 x ratio"] if v is not None
    )
    assert errors["canary"][-1] == 0.5  # the whole window so far: 10 of 20
    # a new step starts a new window: only what came after it counts
    late = [Sample(now + 10 + i * 0.5, 2, i < 10, 0.5) for i in range(20)]
    body = series.guard_series(late, 1, 2, now - 30, now + 20, 0.05, 1.3, windows=[now + 15])
    assert body["errors"]["series"]["canary"][-1] == 0.0


def test_deployment_page_lists_scaling_decisions_and_cold_starts(cp):
    """Events as the autoscale loop and the agents write them (kinds `scaled`, `replica_ready`)."""
    from control_plane.db.models import Event
    from control_plane.db.session import make_sessions

    sessions = make_sessions(cp.database_url)
    with sessions() as db:
        db.add(
            Event(kind="scaled", deployment=NAME, message='1 -> 3: concurrency 5.2 > target 2 {"desired": 3}')
        )
        db.add(Event(kind="replica_ready", deployment=NAME, cluster="aws-us-east-1", replica_id="web-v1-a",
                     message="serving at http://127.0.0.1:1 after a 4.2 s cold start"))  # fmt: skip
        db.commit()
    sessions.kw["bind"].dispose()
    console = Console(cp, cp.read_key)
    panel = console.get(f"/console/deployments/{NAME}/panel").text
    assert "1 → 3" in panel and "concurrency 5.2 &gt; target 2" in panel and '{"desired"' not in panel
    assert "web-v1-a" in panel and "4.20" in panel


def test_deployment_page_shows_the_autoscalers_plan_from_its_stored_decisions(cp):
    """The loops run elsewhere (none in this process): the card and the charts read the
    `scaled` events' decisions."""
    import json

    from control_plane.db.models import Event

    predicted = {"cold_start_s": 42.0, "scale_down_delay_s": 48.0, "burst_need": 4, "burst_held": 4,
                 "burst_hold_s": 300.0, "burst_since_s": 12.0, "bursts": 3, "requests_per_s": 2.5,
                 "prompt_tokens_per_s": 9000.0}  # fmt: skip
    decision = {"desired": 4, "current": 1, "predicted": predicted}
    sessions = make_sessions(cp.database_url)
    with sessions() as db:
        db.add(Event(kind="scaled", deployment=NAME,
                     message=f"1 -> 4: holding 4 replicas for the bursts {json.dumps(decision)}"))  # fmt: skip
        db.commit()
    sessions.kw["bind"].dispose()
    console = Console(cp, cp.read_key)
    panel = console.get(f"/console/deployments/{NAME}/panel").text
    assert 'id="autoscaler"' in panel and "as of its last scaling decision" in panel
    assert "42 s" in panel and "48 s" in panel and "held <strong>4</strong>" in panel and "300 s" in panel
    assert "No forecast has come due yet" in panel
    page = console.get(f"/console/deployments/{NAME}").text
    assert "autoscale.json" in page and 'data-key="autoscale_error"' in page
    charts = console.get(f"/console/deployments/{NAME}/autoscale.json").json()
    assert 4 in charts["autoscale_fleet"]["series"]["burst fleet held"]
    assert 42.0 in charts["autoscale_plan"]["series"]["cold start"]
    assert charts["autoscale_prompt"]["series"] == {}  # the observed load is the loop's own


def test_deployment_series_per_version():
    now = 2_000_000.0
    rows = [series.Row(now + i, 1, 200, 10, 0.5) for i in range(20)]
    rows += [series.Row(now + 10 + i, 2, 500 if i < 2 else 200, 4, 2.0) for i in range(10)]
    charts = series.deployment_series(rows, now - 3600, now + 20)
    assert charts["latency"]["x"][0] <= now < charts["latency"]["x"][1]  # starts at the first request
    assert set(charts["itl"]["series"]) == {"v1", "v2"}
    assert {v for v in charts["itl"]["series"]["v1"] if v is not None} == {0.05}  # 0.5 s / 10 tokens
    assert {v for v in charts["latency"]["series"]["v2 p90"] if v is not None} == {2.0}
    total = sum(v or 0 for v in charts["requests"]["series"]["v2"]) * series.step_for(20)
    assert total == 10  # failed requests count as requests, not in the latency


def test_hourly_cost_series_averages_each_bucket():
    """$/h per deployment: a replica that ran half a bucket counts half its price."""
    since, until = 0.0, 900.0  # 90 buckets of 10 s
    held = [
        series.Held("a", 4.0, -100.0, None),  # all along
        series.Held("b", 2.0, 5.0, 25.0),  # half of bucket 0, all of bucket 1, half of bucket 2
    ]
    chart = series.hourly_series(held, since, until)["hourly"]
    assert series.step_for(until - since) == 10 and len(chart["x"]) == 91
    assert chart["series"]["a"][:3] == [4.0, 4.0, 4.0]
    assert chart["series"]["b"][:4] == [1.0, 2.0, 1.0, 0.0]
    assert chart["series"]["total"][:3] == [5.0, 6.0, 5.0]
    assert series.hourly_series([], since, until)["hourly"]["series"] == {}


def test_the_deployment_page_names_its_engine(cp):
    page = Console(cp, cp.token).get(f"/console/deployments/{NAME}").text
    assert '<strong id="engine">fleet</strong>' in page
    assert '<th scope="col">Engine</th>' in page
