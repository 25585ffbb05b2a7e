"""The agent's pre-pull (agent/models.py) against a real local HTTP server: one pull
however many replicas ask, a failure kept (no hot retry loop) until `retry`, the cache
as heartbeats report it, and `models rm` refused while a deployment uses the model."""

from __future__ import annotations

import hashlib
import os

from agent.models import ModelPuller
from fleet_base.models import ModelCache
from fleet_base.protocol import ModelCommand
from tests.fleet_base.models.servers import FileServer, serve
from tests.polling import eventually


async def _settle(puller: ModelPuller, uri: str) -> str:
    def settled() -> str | None:
        pull = puller.status(uri)
        return pull.state if pull is not None and pull.state != "pulling" else None

    return await eventually(settled, 20, "the pull to finish")


async def test_pull_once_report_and_refuse_rm_in_use(tmp_path) -> None:
    data = os.urandom(500_000)
    files = FileServer({"m.gguf": data}, delay_s=0.005)
    woke = []
    with serve(files.app()) as base:
        uri = f"{base}/m.gguf#sha256={hashlib.sha256(data).hexdigest()}"
        puller = ModelPuller(ModelCache(tmp_path / "cache"), on_change=lambda: woke.append(1))
        puller.prefetch([uri, "smollm2-135m"])  # local names are not pulled
        assert puller.ensure(uri).state == "pulling"  # a second replica joins the same pull
        report = puller.report()
        assert [(m.state, m.in_use) for m in report] == [("pulling", True)]
        assert await _settle(puller, uri) == "ready"
        assert len(files.gets) == 1 and woke
        report = puller.report()
        assert report[0].state == "ready" and report[0].size_bytes == len(data) and report[0].in_use
        refused = await puller.command(ModelCommand(action="rm", uri=uri))
        assert not refused.ok and "in use" in refused.message
        puller.prefetch([])  # the deployment went away
        removed = await puller.command(ModelCommand(action="rm", uri=uri))
        assert removed.ok and puller.report() == []


async def test_a_failed_pull_waits_for_retry(tmp_path) -> None:
    with serve(FileServer({}).app()) as base:
        uri = f"{base}/absent.gguf#sha256={'0' * 64}"
        puller = ModelPuller(ModelCache(tmp_path / "cache"))
        puller.ensure(uri)
        assert await _settle(puller, uri) == "failed"
        assert "missing_object" in puller.status(uri).error
        puller.prefetch([uri])  # the next reconcile pass does not start it again
        assert puller.status(uri).state == "failed"
        puller.retry(uri)  # a replica's backoff ended
        assert puller.ensure(uri).state == "pulling"
        assert await _settle(puller, uri) == "failed"
        bad = await puller.command(ModelCommand(action="pull", uri="ftp://x/y"))
        assert not bad.ok and "unknown_scheme" in bad.message


def test_cold_start_parts_travel_from_engine_metrics_to_the_gateway() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from agent.gateway.coldstart import ColdStartCollector
    from agent.replica_metrics import parse_metrics
    from engine.server.metrics import ServerMetrics
    from fleet_base.protocol import ReplicaState, ReplicaStatus

    engine = ServerMetrics("m")
    engine.startup.update(pull=1.5, load=2.5, warmup=0.25)
    sample = parse_metrics(generate_latest(engine.registry).decode())
    assert dict(sample.startup) == {"load": 2.5, "warmup": 0.25}  # the agent measures the pull itself

    status = ReplicaStatus(
        replica_id="r1",
        deployment="d",
        version=1,
        state=ReplicaState.ready,
        cold_start_s=4.0,
        pull_s=0.0,
        load_s=2.5,
        warmup_s=0.25,
    )
    registry = CollectorRegistry()
    registry.register(ColdStartCollector(lambda: [status]))
    text = generate_latest(registry).decode()
    assert 'fleet_agent_model_pull_seconds{deployment="d",replica="r1"} 0.0' in text
    assert 'fleet_agent_model_load_seconds{deployment="d",replica="r1"} 2.5' in text
    assert 'fleet_agent_model_warmup_seconds{deployment="d",replica="r1"} 0.25' in text
    assert "fleet_agent_model_first_token_seconds{" not in text  # no request served yet
