"""fleetctl's resource commands as a user runs them: subprocesses with FLEET_HOME pointing
at a real control plane (which wrote its URL and admin token there), `-o json` for the
assertions, tables for people, one line on stderr and a non-zero exit on errors."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from fleet_base.ports import free_port
from tests.control_plane.cp_server import ControlPlaneServer
from tests.fleetctl import fleetctl as run_fleetctl


@pytest.fixture(scope="module")
def server(sqlite_server: ControlPlaneServer) -> ControlPlaneServer:
    return sqlite_server


def fleetctl(home, *args: str, env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    return run_fleetctl(home, *args, env={"COLUMNS": "200", **(env or {})}, timeout=60, check=ok)


def fleetctl_many(home, *commands: list[str], env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Independent commands at once (each is mostly interpreter start-up)."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: fleetctl(home, *args, env=env, ok=False), commands))


def as_json(home, *args: str) -> dict | list:
    return json.loads(fleetctl(home, *args, "-o", "json").stdout)


def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_deploy_update_scale_status_ls_delete(server):
    home = server.home
    out = fleetctl(
        home,
        "deploy",
        "chat",
        "--model",
        "smollm2-135m",
        "--min-replicas",
        "1",
        "--max-replicas",
        "3",
        "--gpu",
        "L4",
        "--gpu",
        "A100",
        "--regions",
        "eu-west,us-east",
        "-e",
        "max_num_seqs=8",
    )
    assert "chat" in out.stdout and "smollm2-135m" in out.stdout

    status = as_json(home, "status", "chat")
    assert {"ready_replicas", "desired_replicas", "versions", "placements"} <= set(status)
    assert status["desired_replicas"] == 1 and status["ready_replicas"] == 0 and status["placements"] == []
    spec = status["versions"][0]
    assert spec["gpu_models"] == ["L4", "A100"] and spec["regions"] == ["eu-west", "us-east"]
    assert spec["engine_args"] == {"max_num_seqs": 8}

    again = as_json(home, "deploy", "chat", "--model", "smollm2-135m")  # nothing changed: no new version
    assert again["current_version"] == 1
    changed = as_json(home, "deploy", "chat", "-e", "max_num_seqs=16", "-e", "enforce_eager=true")
    assert changed["current_version"] == 2 and changed["spec"]["engine_args"] == {
        "max_num_seqs": 16,
        "enforce_eager": True,
    }
    assert changed["spec"]["gpu_models"] == ["L4", "A100"]  # unchanged fields carry over

    scaled = as_json(home, "scale", "chat", "3")
    assert scaled["desired_replicas"] == 3 and scaled["current_version"] == 2
    err = one_line_error(fleetctl(home, "scale", "chat", "7", ok=False))
    assert "replicas" in err and "1..3" in err and "422" in err

    pinned = as_json(home, "deploy", "pinned", "--model", "m", "--replicas", "2")
    assert (pinned["desired_replicas"], pinned["min_replicas"], pinned["max_replicas"]) == (2, 2, 2)
    repinned = as_json(home, "deploy", "pinned", "--replicas", "4")
    assert (repinned["desired_replicas"], repinned["min_replicas"], repinned["max_replicas"]) == (4, 4, 4)

    listed = {d["name"]: d for d in as_json(home, "ls")}
    assert {"chat", "pinned"} <= set(listed) and listed["chat"]["desired_replicas"] == 3
    assert [d["name"] for d in as_json(home, "ls", "--model", "m")] == ["pinned"]
    table = fleetctl(home, "ls").stdout
    assert "chat" in table and "pinned" in table and "desired" in table

    assert as_json(home, "delete", "pinned")["name"] == "pinned"
    assert "not found" in one_line_error(fleetctl(home, "status", "pinned", ok=False))
    assert "deleted chat" in fleetctl(home, "delete", "chat").stdout


def test_deploy_from_file_and_flag_errors(server, tmp_path):
    home = server.home
    spec = tmp_path / "deployment.yaml"
    spec.write_text(
        "name: from-file\nmodel: smollm2-135m\nmin_replicas: 0\nmax_replicas: 2\n"
        "scale_to_zero: true\nengine_args:\n  max_num_seqs: 4\n"
    )
    made = as_json(home, "deploy", "-f", str(spec), "--max-replicas", "3")  # flags override the file
    assert made["name"] == "from-file" and made["spec"]["scale_to_zero"] is True
    assert (made["min_replicas"], made["max_replicas"], made["desired_replicas"]) == (0, 3, 1)
    assert made["spec"]["engine_args"] == {"max_num_seqs": 4}

    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("- just\n- a list\n")
    no_model, bad_arg, bad_name, min_max, not_mapping = map(
        one_line_error,
        fleetctl_many(
            home,
            ["deploy", "nomodel"],
            ["deploy", "x", "--model", "m", "-e", "oops"],
            ["deploy", "Bad_Name", "--model", "m"],
            ["deploy", "x2", "--model", "m", "--min-replicas", "3", "--max-replicas", "1"],
            ["deploy", "-f", str(bad_file)],
        ),
    )
    assert "--model is required" in no_model and "KEY=VALUE" in bad_arg
    assert "name" in bad_name and "422" in bad_name and "min_replicas" in min_max and "mapping" in not_mapping


def test_keys_create_ls_revoke(server):
    home = server.home
    created = as_json(
        home,
        "keys",
        "create",
        "app",
        "--deployment",
        "chat",
        "--tokens-per-minute",
        "1000",
        "--requests-per-minute",
        "60",
    )
    assert created["key"].startswith(f"fleet-{created['key_id']}-")
    assert created["scopes"] == ["inference"] and created["deployments"] == ["chat"]
    assert created["quotas"]["tokens_per_minute"] == 1000 and created["quotas"]["requests_per_minute"] == 60
    table = fleetctl(home, "keys", "create", "reader", "--scope", "read").stdout
    assert "shown once" in table and "fleet-" in table
    assert created["webhook_secret"].startswith("whsec_")
    assert "webhook signing secret (shown once): whsec_" in table
    rotated = as_json(home, "keys", "webhook-secret", created["key_id"])
    assert rotated["webhook_secret_version"] == 1 and rotated["webhook_secret"] != created["webhook_secret"]
    assert (
        "version 2, shown once): whsec_" in fleetctl(home, "keys", "webhook-secret", created["key_id"]).stdout
    )

    listed = as_json(home, "keys", "ls")
    assert created["key_id"] in [k["key_id"] for k in listed]
    assert created["key"] not in json.dumps(listed) and all("hash" not in k for k in listed)

    revoked = as_json(home, "keys", "revoke", created["key_id"])
    assert revoked["revoked"] is True
    active = as_json(home, "keys", "ls", "--active")
    assert created["key_id"] not in [k["key_id"] for k in active]
    assert "not found" in one_line_error(fleetctl(home, "keys", "revoke", "nope", ok=False))

    # the read key can look but not touch
    reader = as_json(home, "keys", "create", "ro", "--scope", "read")["key"]
    looked, touched = fleetctl_many(
        home, ["ls", "-o", "json"], ["scale", "x", "1"], env={"FLEET_TOKEN": reader}
    )
    assert looked.returncode == 0 and isinstance(json.loads(looked.stdout), list)
    assert "403" in one_line_error(touched)


def test_clusters_pools_events_audit(server):
    home = server.home
    with server.client() as admin:
        assert (
            admin.post(
                "/v1/clusters",
                json={
                    "id": "gcp-eu",
                    "region": "europe-west4",
                    "provider": "gcp",
                    "pools": [
                        {"name": "l4", "gpu_model": "L4", "gpus_per_node": 4, "nodes": 2, "tier": "spot"}
                    ],
                },
            ).status_code
            == 201
        )
    clusters = as_json(home, "clusters")
    assert [c["id"] for c in clusters] == ["gcp-eu"] and clusters[0]["status"] == "healthy"
    assert as_json(home, "cordon", "gcp-eu")["status"] == "draining"
    assert [c["id"] for c in as_json(home, "clusters", "--status", "draining")] == ["gcp-eu"]
    assert as_json(home, "uncordon", "gcp-eu")["status"] == "healthy"
    pools = as_json(home, "pools", "--cluster", "gcp-eu")
    assert [(p["name"], p["total_gpus"], p["free_gpus"]) for p in pools] == [("l4", 8, 8)]
    assert as_json(home, "pools", "--tier", "reserved") == []
    assert "europe-west4" in fleetctl(home, "pools").stdout

    as_json(home, "deploy", "evented", "--model", "m")
    events = as_json(home, "events", "--deployment", "evented")
    assert [e["kind"] for e in events] == ["deployment_created"]
    assert len(as_json(home, "events", "--limit", "2")) == 2
    assert any(e["kind"] == "cluster_draining" for e in as_json(home, "events", "--cluster", "gcp-eu"))
    audit = as_json(home, "audit", "--resource-type", "cluster")
    assert [a["action"] for a in audit] == ["cluster.uncordon", "cluster.cordon", "cluster.create"]
    assert "cluster.cordon" in fleetctl(home, "audit").stdout


def test_clear_errors_when_the_control_plane_is_unreachable_or_token_missing(server, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    commands = (["ls"], ["status", "x"], ["deploy", "x", "--model", "m"], ["keys", "ls"], ["events"])
    for res in fleetctl_many(tmp_path, *commands, env={"FLEET_API_URL": dead}):
        err = one_line_error(res)
        assert "unreachable" in err and dead in err
    # a FLEET_HOME without a token: the API's 401, with a hint
    err = one_line_error(fleetctl(tmp_path, "ls", env={"FLEET_API_URL": server.url}, ok=False))
    assert "401" in err and "token" in err.lower()


def test_deploy_and_scale_priority_and_surge_flags(server):
    """In-process (typer's runner against the live server): these are many small calls."""
    from typer.testing import CliRunner

    from control_plane.cli import app

    env = {"FLEET_HOME": str(server.home), "FLEET_API_URL": None, "FLEET_TOKEN": None, "COLUMNS": "200"}

    def run(*args: str, ok: bool = True):
        res = CliRunner().invoke(app, list(args), env=env)
        assert (res.exit_code == 0) == ok, (args, res.output)
        return res

    def as_json(*args: str) -> dict | list:
        return json.loads(run(*args, "-o", "json").stdout)

    made = as_json(
        "deploy", "prio", "--model", "m", "--min-replicas", "1", "--max-replicas", "4", "--priority",
        "batch", "--max-surge", "0", "--max-unavailable", "50%",
    )  # fmt: skip
    assert (made["priority"], made["max_surge"], made["max_unavailable"]) == ("batch", "0", "50%")
    assert made["current_version"] == 1  # unversioned fields: no new version
    scaled = as_json("scale", "prio", "2", "--priority", "critical", "--max-surge", "1")
    assert (scaled["desired_replicas"], scaled["priority"], scaled["max_surge"]) == (2, "critical", "1")
    assert scaled["max_unavailable"] == "50%" and scaled["current_version"] == 1  # untouched fields stay
    again = as_json("deploy", "prio", "--max-unavailable", "1")
    assert (again["priority"], again["max_surge"], again["max_unavailable"]) == ("critical", "1", "1")
    row = next(d for d in as_json("ls") if d["name"] == "prio")
    assert (row["priority"], row["max_surge"], row["max_unavailable"]) == ("critical", "1", "1")
    table = run("ls").stdout
    assert "priority" in table and "critical" in table and "surge" in table
    for args, words in [
        (["deploy", "prio", "--priority", "urgent"], ["priority", "422"]),
        (["deploy", "prio", "--max-surge", "-1"], ["max_surge", "422"]),
        (["scale", "prio", "2", "--max-unavailable", "150%"], ["max_unavailable", "100%"]),
        (["scale", "prio", "2", "--max-surge", "0", "--max-unavailable", "0"], ["cannot both be 0", "422"]),
        (["scale", "prio", "2", "--priority", "low"], ["priority", "422"]),
    ]:
        res = run(*args, ok=False)
        assert res.exit_code == 1 and all(w in res.stderr for w in words), (args, res.stderr)
        assert res.stderr.strip().startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
    assert as_json("status", "prio")["priority"] == "critical"  # nothing bad was applied
    run("delete", "prio")


def test_deploy_with_lora_and_lora_ls_add_rm(server):
    """In-process, like the priority flags test: a few small calls."""
    from typer.testing import CliRunner

    from control_plane.cli import app

    env = {"FLEET_HOME": str(server.home), "FLEET_API_URL": None, "FLEET_TOKEN": None, "COLUMNS": "200"}

    def run(*args: str, ok: bool = True):
        res = CliRunner().invoke(app, list(args), env=env)
        assert (res.exit_code == 0) == ok, (args, res.output)
        return res

    def as_json(*args: str) -> dict:
        return json.loads(run(*args, "-o", "json").stdout)

    out = as_json("deploy", "lo", "--model", "m", "--lora", "sql=/a/sql", "--max-adapters", "2")
    assert out["adapters"] == [{"name": "sql", "uri": "/a/sql"}] and out["max_adapters"] == 2
    run("lora", "add", "lo", "chat=/a/chat")
    table = run("lora", "ls", "lo").stdout
    assert "sql" in table and "/a/chat" in table and "max 2" in table
    assert [a["name"] for a in as_json("lora", "rm", "lo", "sql")["adapters"]] == ["chat"]
    bad = run("lora", "add", "lo", "nouri", ok=False)
    assert "NAME=URI" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "not found" in run("lora", "rm", "lo", "sql", ok=False).stderr
    run("delete", "lo")


def test_residency_flags_on_enroll_clusters_set_deploy_and_keys(server, tmp_path):
    home = server.home
    enrolled = as_json(
        home, "clusters", "enroll", "res-ca", "--jurisdiction", "CA", "--out", str(tmp_path / "b")
    )
    assert enrolled["jurisdiction"] == "ca"
    with server.client() as admin:  # enrolment registered it with its jurisdiction
        assert admin.get("/v1/clusters/res-ca").json()["jurisdiction"] == "ca"
    dep, key = fleetctl_many(
        home,
        ["deploy", "res-d", "--model", "m", "--residency", "eu,ca", "-o", "json"],
        ["keys", "create", "res-k", "--residency", "ca", "-o", "json"],
    )
    assert json.loads(dep.stdout)["residency"] == ["eu", "ca"]
    key_id = json.loads(key.stdout)["key_id"]
    assert json.loads(key.stdout)["residency"] == ["ca"]

    assert as_json(home, "clusters", "set", "res-ca", "--jurisdiction", "us")["jurisdiction"] == "us"
    clusters, status, *bad = fleetctl_many(
        home,
        ["clusters"],
        ["status", "res-d"],
        ["deploy", "res-x", "--model", "m", "--residency", "c a"],
        ["clusters", "set", "res-ca", "--jurisdiction", "x_y"],
    )
    assert "jurisdiction" in clusters.stdout and "us" in clusters.stdout.split("res-ca", 1)[1].splitlines()[0]
    assert "residency" in status.stdout and "eu, ca" in status.stdout
    reasons = [one_line_error(res) for res in bad]
    assert "--residency 'c a'" in reasons[0] and "not a label" in reasons[0]
    assert "--jurisdiction 'x_y'" in reasons[1]

    cleared_key, cleared_dep = fleetctl_many(
        home,
        ["keys", "update", key_id, "--clear", "residency", "-o", "json"],
        ["deploy", "res-d", "--residency", "", "-o", "json"],
    )
    assert json.loads(cleared_key.stdout)["residency"] is None
    assert json.loads(cleared_dep.stdout)["residency"] is None


def test_keys_team_on_create_update_and_clear(server):
    """`keys create NAME --team T` and `keys update --team` set the team a key's usage is
    charged to; `--clear team` removes it; a bad team name is a one-line error."""
    home = server.home
    created = as_json(home, "keys", "create", "team-k", "--team", "ml-infra")
    assert created["team"] == "ml-infra"
    moved, bad = fleetctl_many(
        home,
        ["keys", "update", created["key_id"], "--team", "search", "-o", "json"],
        ["keys", "create", "team-x", "--team", "ml infra"],
    )
    assert json.loads(moved.stdout)["team"] == "search"
    assert "team" in one_line_error(bad)
    listed = {k["key_id"]: k for k in as_json(home, "keys", "ls")}
    assert listed[created["key_id"]]["team"] == "search"
    cleared = as_json(home, "keys", "update", created["key_id"], "--clear", "team")
    assert cleared["team"] is None


def test_local_fleet_enrols_its_clusters_with_their_jurisdictions(server):
    """`fleetctl up --jurisdictions` records each local cluster's jurisdiction at enrolment
    (LocalFleet.register_cluster), and refuses a pair naming no --regions cluster."""
    from control_plane.local.fleet import LocalFleet
    from fleet_base.cluster_config import ClusterConfig

    fleet = LocalFleet(server.home)
    state = fleet.new_state(["res-east", "res-west"], {"res-east": "ca"})
    state.api_url = server.url
    for region in state.regions:
        fleet.register_cluster(state, ClusterConfig(cluster=region, region=region))
    state.jurisdictions["res-west"] = "us"  # re-enrolled (already recorded): updated
    fleet.register_cluster(state, ClusterConfig(cluster="res-west", region="res-west"))
    with server.client() as admin:
        rows = {c["id"]: c["jurisdiction"] for c in admin.get("/v1/clusters").json()["items"]}
    assert (rows["res-east"], rows["res-west"]) == ("ca", "us")
    bad = fleetctl(home := server.home, "up", "--regions", "a,b", "--jurisdictions", "a=ca,c=us", ok=False)
    assert "--jurisdictions names c, not in --regions" in one_line_error(bad)
    assert "not CLUSTER=JURISDICTION" in one_line_error(
        fleetctl(home, "up", "--jurisdictions", "ca", ok=False)
    )
