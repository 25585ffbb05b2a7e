"""A deployment's engine on the control plane, in process against SQLite: the API field
(default fleet, a bad one a 422 listing the engines), the GPUs per replica taken from the
engine's parallel sizes, deploy-time refusals from the engine's capabilities, the engine
through rollouts and updates, the HiGHS placer reserving a replica's GPUs on one node, the
desired state carrying `ReplicaSpec.engine`, and `fleetctl deploy --engine`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from control_plane.api import specs
from control_plane.api.app import build_app
from control_plane.api.errors import ApiError
from control_plane.api.routers.keys import make_key
from control_plane.api.schemas import DeploymentCreate
from control_plane.context import ControlPlaneContext
from control_plane.fleet_model.plan import build_desired, next_assignments, placement_inputs
from control_plane.fleet_model.snapshot import read_snapshot
from control_plane.placement import PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import violations
from control_plane.placement.milp import MilpPlacer
from control_plane.settings import Settings

GGUF = "/models/SmolLM2-135M-Instruct-Q8_0.gguf"
H100 = {"name": "h100", "gpu_model": "H100", "gpus_per_node": 8, "nodes": 2, "hourly_price": 80.0}


class Api:
    def __init__(self, app, sessions) -> None:
        self.app, self.sessions = app, sessions

    def client(self) -> TestClient:
        row, secret = make_key("tester", ["admin"], None, {})
        with self.sessions() as s:
            s.add(row)
            s.commit()
        return TestClient(self.app, headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture
def api(sessions, tmp_path) -> Iterator[Api]:
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions)
    yield Api(build_app(ctx, run_loops=False), sessions)


@pytest.fixture
def admin(api: Api) -> Iterator[TestClient]:
    with api.client() as client:
        yield client


def cluster(admin: TestClient, *pools: dict, name: str = "gpu-east") -> None:
    r = admin.post("/v1/clusters", json={"id": name, "region": "us-east", "pools": list(pools)})
    assert r.status_code == 201, r.text


def deploy(admin: TestClient, name: str, **body) -> dict:
    r = admin.post("/v1/deployments", json={"name": name, **body})
    assert r.status_code == 201, r.text
    return r.json()


def refused(response, field: str, *words: str) -> str:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    for word in words:
        assert word in error["message"], error
    return error["message"]


def test_engine_defaults_to_fleet_and_shows_in_every_view(admin):
    made = deploy(admin, "chat", model="smollm2-135m")
    assert made["engine"] == "fleet" and made["spec"]["engine"] == "fleet"
    big = deploy(
        admin, "big", model="/models/llama-70b", engine="vllm", engine_args={"tensor_parallel_size": 4}
    )
    assert big["engine"] == "vllm" and big["spec"]["gpu_count"] == 4
    listed = {d["name"]: d["engine"] for d in admin.get("/v1/deployments").json()["items"]}
    assert listed == {"big": "vllm", "chat": "fleet"}
    assert admin.get("/v1/deployments/big/versions/1").json()["engine"] == "vllm"


def test_an_unknown_engine_is_a_422_listing_the_engines(admin):
    r = admin.post("/v1/deployments", json={"name": "x", "model": "m", "engine": "tgi"})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert all(kind in message for kind in ("fleet", "vllm", "sglang", "llama.cpp")), message


def test_gpus_per_replica_follow_the_parallel_sizes(admin):
    made = deploy(
        admin,
        "moe",
        model="/models/mixtral",
        engine="vllm",
        engine_args={"tensor-parallel-size": 2, "pipeline_parallel_size": 2},  # '-' stored as '_'
    )
    assert made["spec"]["engine_args"] == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    # keys are stored as the agent's argv builder takes them: lower case, '_' for '-'
    fleet = deploy(
        admin, "sim", model="m", engine_args={"profile_A100": "llama2-70b-a100-tp4", "Max-Num-Seqs": 8}
    )
    assert fleet["spec"]["engine_args"] == {"profile_a100": "llama2-70b-a100-tp4", "max_num_seqs": 8}
    assert made["spec"]["gpu_count"] == 4
    sg = deploy(admin, "sg", model="/models/qwen", engine="sglang", engine_args={"tp_size": 2}, gpu_count=2)
    assert sg["spec"]["gpu_count"] == 2  # agreeing is fine
    r = admin.post(
        "/v1/deployments",
        json={
            "name": "x",
            "model": "m",
            "engine": "vllm",
            "engine_args": {"tensor_parallel_size": 4},
            "gpu_count": 8,
        },
    )
    refused(r, "gpu_count", "8", "4 GPUs per replica")
    # llama.cpp and fleet keep what resources say
    cpp = deploy(admin, "cpp", model=GGUF, engine="llama.cpp", engine_args={"n_gpu_layers": 99}, gpu_count=2)
    assert cpp["spec"]["gpu_count"] == 2 and cpp["spec"]["engine_args"] == {"n_gpu_layers": 99}


def test_an_update_that_drops_the_parallel_sizes_drops_their_gpu_count(admin):
    deploy(admin, "big", model="/models/llama-70b", engine="vllm", engine_args={"tensor_parallel_size": 4})
    v2 = admin.patch("/v1/deployments/big", json={"engine_args": {"tensor_parallel_size": 2}}).json()
    assert v2["current_version"] == 2 and v2["spec"]["gpu_count"] == 2
    v3 = admin.patch("/v1/deployments/big", json={"engine_args": {"max_model_len": 8192}}).json()
    assert v3["current_version"] == 3 and v3["spec"]["gpu_count"] == 1
    v4 = admin.patch("/v1/deployments/big", json={"engine": "sglang", "gpu_count": 2}).json()
    assert (v4["current_version"], v4["engine"], v4["spec"]["gpu_count"]) == (4, "sglang", 2)
    assert [v["engine"] for v in v4["versions"]] == ["vllm", "vllm", "vllm", "sglang"]


def test_capabilities_refuse_at_deploy(admin):
    r = admin.post("/v1/deployments", json={"name": "x", "model": "smollm2-135m", "engine": "llama.cpp"})
    refused(r, "model", "GGUF", "smollm2-135m")
    r = admin.post(
        "/v1/deployments",
        json={
            "name": "x",
            "model": GGUF,
            "engine": "llama.cpp",
            "adapters": [{"name": "sql", "uri": "/a/sql"}],
        },
    )
    refused(r, "adapters", "llama.cpp", "LoRA")
    r = admin.post(
        "/v1/deployments",
        json={"name": "x", "model": GGUF, "engine": "llama.cpp", "engine_args": {"tensor_parallel_size": 2}},
    )
    refused(r, "engine", "llama.cpp", "tensor")
    r = admin.post(
        "/v1/deployments", json={"name": "x", "model": "m", "engine": "vllm", "engine_args": {"port": 1}}
    )
    refused(r, "engine_args", "launcher")
    # adapters added later, by deploy or by `fleetctl lora add`, meet the same rule
    deploy(admin, "cpp", model=GGUF, engine="llama.cpp")
    r = admin.post("/v1/deployments/cpp/adapters", json={"name": "sql", "uri": "/a/sql"})
    refused(r, "adapters", "llama.cpp")
    r = admin.patch("/v1/deployments/cpp", json={"adapters": [{"name": "sql", "uri": "/a/sql"}]})
    refused(r, "adapters", "llama.cpp")
    # and a deployment with adapters cannot move to such an engine
    deploy(admin, "lora", model="smollm2-135m", adapters=[{"name": "sql", "uri": "/a/sql"}])
    r = admin.patch("/v1/deployments/lora", json={"engine": "llama.cpp", "model": GGUF})
    refused(r, "adapters", "llama.cpp")
    assert admin.get("/v1/deployments/lora").json()["current_version"] == 1


def test_a_tensor_parallel_size_no_node_holds_is_refused(admin):
    # no pools known yet: nothing to judge by, accepted (placement reports it unplaced)
    deploy(admin, "early", model="/m", engine="vllm", engine_args={"tensor_parallel_size": 16})
    cluster(admin, H100, {"name": "l4", "gpu_model": "L4", "gpus_per_node": 2, "nodes": 4})
    r = admin.post(
        "/v1/deployments",
        json={"name": "x", "model": "/m", "engine": "vllm", "engine_args": {"tensor_parallel_size": 16}},
    )
    refused(r, "engine_args", "16 GPUs per replica", "largest node of a matching pool has 8")
    r = admin.post(
        "/v1/deployments",
        json={
            "name": "x",
            "model": "/m",
            "engine": "sglang",
            "engine_args": {"tp_size": 4},
            "gpu_models": ["L4"],
        },
    )
    refused(r, "engine_args", "4 GPUs per replica", "has 2")
    deploy(admin, "fits", model="/m", engine="sglang", engine_args={"tp_size": 8})
    r = admin.patch("/v1/deployments/fits", json={"engine_args": {"tp_size": 16}})
    refused(r, "engine_args", "16 GPUs")


def test_a_canary_may_change_the_engine(admin):
    deploy(admin, "web", model="/models/llama-8b", replicas=2)
    r = admin.post(
        "/v1/deployments/web/rollouts",
        json={"spec": {"engine": "vllm", "engine_args": {"tensor_parallel_size": 2}}},
    )
    assert r.status_code == 201, r.text
    status = admin.get("/v1/deployments/web").json()
    canary = status["versions"][-1]
    assert (canary["version"], canary["engine"], canary["gpu_count"]) == (2, "vllm", 2)
    assert status["engine"] == "fleet"  # the current version until promoted
    assert admin.post("/v1/deployments/web/rollouts/current/abort").status_code == 200
    r = admin.post("/v1/deployments/web/rollouts", json={"spec": {"engine": "llama.cpp"}})
    refused(r, "model", "GGUF")


def test_placement_reserves_the_replica_gpus_on_one_node_and_desired_state_names_the_engine(api, admin):
    cluster(admin, H100, {"name": "cpu", "gpu_model": "cpu", "gpus_per_node": 4, "nodes": 1})
    deploy(
        admin, "big", model="/models/llama-70b", engine="vllm", engine_args={"tensor_parallel_size": 4}, replicas=3,
        gpu_models=["H100"],
    )  # fmt: skip
    deploy(admin, "cpp", model=GGUF, engine="llama.cpp", gpu_models=["cpu"], replicas=2)
    with api.sessions() as s:
        snap = read_snapshot(s)
    demands, pools, current = placement_inputs(snap)
    result = MilpPlacer(time_limit_s=20, mip_gap=0.0).place(demands, pools, current)
    assert violations(demands, pools, result.added) == []
    assert sorted((a.deployment, a.gpus) for a in result.added) == [("big", 4)] * 3 + [("cpp", 1)] * 2
    by_node: dict = {}
    for a in result.added:
        if a.deployment == "big":
            by_node[(a.pool, a.node)] = by_node.get((a.pool, a.node), 0) + a.gpus
    assert sorted(by_node.values()) == [4, 8]  # two on one 8-GPU node, one on the other
    replicas = build_desired(snap, next_assignments(snap, result))["gpu-east"].replicas
    assert sorted((r.deployment, r.engine, r.resources.gpu_count) for r in replicas) == [
        ("big", "vllm", 4),
        ("big", "vllm", 4),
        ("big", "vllm", 4),
        ("cpp", "llama.cpp", 1),
        ("cpp", "llama.cpp", 1),
    ]
    assert {r.engine_args["tensor_parallel_size"] for r in replicas if r.deployment == "big"} == {4}


@settings(max_examples=25, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2]),
    per_node=st.sampled_from([1, 2, 4, 8]),
    nodes=st.integers(1, 3),
    replicas=st.integers(1, 4),
)
def test_property_a_replica_takes_tp_x_pp_gpus_of_one_node(tp, pp, per_node, nodes, replicas):
    body = DeploymentCreate(
        name="d", model="/m", engine="vllm", replicas=replicas,
        engine_args={"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
    )  # fmt: skip
    spec, _ = specs.new_spec(body)
    assert spec["gpu_count"] == tp * pp
    pool = PoolCapacity(cluster="c", name="p", gpu_model="H100", gpus_per_node=per_node, nodes=nodes)
    try:
        specs.check_node_fit(spec, [pool])
    except ApiError:
        assert tp * pp > per_node
        return
    assert tp * pp <= per_node or tp * pp == 1
    demand = ReplicaDemand(deployment="d", version=1, count=replicas, gpu_count=spec["gpu_count"])
    result = MilpPlacer(time_limit_s=10, mip_gap=0.0).place([demand], [pool])
    assert violations([demand], [pool], result.added) == []
    assert all(a.gpus == tp * pp for a in result.added)
    assert len(result.added) == min(replicas, nodes * (per_node // (tp * pp)))


# --------------------------------------------------------------------- fleetctl


@pytest.fixture
def fleetctl(api, monkeypatch, tmp_path):
    """`fleetctl` (CliRunner) whose API client talks to the in-process app."""
    from control_plane import client as client_module
    from control_plane.cli import app

    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")  # tables wide enough to show every column whole
    headers = dict(api.client().headers)
    original = client_module.FleetClient.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.urls, self.url = ["http://testserver"], "http://testserver"
        self._http = TestClient(api.app, headers=headers)  # closed by the command, like its own

    monkeypatch.setattr(client_module.FleetClient, "__init__", init)
    return lambda *args: CliRunner().invoke(app, list(args))


def test_fleetctl_deploy_engine_and_pass_through_engine_args(fleetctl):
    result = fleetctl(
        "deploy", "big", "--engine", "vllm", "--model", "/models/llama-70b",
        "-e", "tensor_parallel_size=4", "-e", "--max-model-len=8192", "-o", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    made = json.loads(result.output)
    assert made["engine"] == "vllm" and made["spec"]["gpu_count"] == 4
    assert made["spec"]["engine_args"] == {"tensor_parallel_size": 4, "max_model_len": 8192}
    result = fleetctl("deploy", "cpp", "--engine", "llama.cpp", "--model", GGUF, "-e", "n_gpu_layers=99")
    assert result.exit_code == 0, result.output
    assert "note: llama.cpp has no per-tenant cache salt" in result.output  # said at deploy
    table = fleetctl("ls")
    assert table.exit_code == 0 and "engine" in table.output and "llama.cpp" in table.output
    assert "vllm" in table.output
    result = fleetctl("deploy", "sg", "--engine", "sglang", "--model", "/m", "-e", "tp_size=2", "-o", "json")
    assert json.loads(result.output)["spec"]["gpu_count"] == 2
    result = fleetctl("deploy", "sg1", "--engine", "sglang", "--model", "/m")
    assert "note: sglang has no per-tenant cache salt" in result.output and "single tenant" in result.output
    result = fleetctl("deploy", "v1", "--engine", "vllm", "--model", "/m")
    assert result.exit_code == 0 and "note:" not in result.output  # vLLM takes the per-key salt


def test_fleetctl_deploy_refusals_are_one_line_with_the_reason(fleetctl):
    result = fleetctl("deploy", "cpp", "--engine", "llama.cpp", "--model", "smollm2-135m")
    assert result.exit_code == 1 and "GGUF" in result.output
    result = fleetctl("deploy", "x", "--engine", "tgi", "--model", "m")
    assert result.exit_code != 0 and "llama.cpp" in result.output


def test_the_autoscaler_sees_the_version_engine(api, admin):
    from control_plane.autoscale.observe import settings_of
    from control_plane.db.models import DeploymentVersion

    deploy(
        admin, "sg", model="/m", engine="sglang", engine_args={"tp_size": 2}, min_replicas=1, max_replicas=4
    )
    with api.sessions() as s:
        (version,) = s.query(DeploymentVersion).all()
        settings = settings_of(version)
    assert settings.engine == "sglang" and settings.max_replicas == 4
    assert settings_of(object()).engine == "fleet"  # a row from before engines: Fleet's own
