"""The agent's pre-pull (agent/models.py) against a real local HTTP server: one pull
however many replicas ask, a failure kept (no hot retry loop) until `retry`, the cache
as heartbeats report it, and `models rm` refused while a deployment uses the model."""

from __future__ import annotations

import hashlib
import os

import pytest

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


class _LoadedAdapters:
    """A replica's LoRA API that says which adapters it holds (agent.adapters.ReplicaAdapters)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    async def loaded(self, url: str) -> list[str]:
        return list(self.names)


async def test_an_adapter_a_running_replica_uses_is_never_evicted(tmp_path) -> None:
    """A replica pulled an adapter and serves it; another model then needs room in the
    bounded node cache. Eviction (in whichever process pulls) keeps what replicas use: the
    new pull is refused rather than the adapter's files deleted under the replica."""
    from agent.adapter_controller import AdapterController
    from agent.replica import Replica
    from agent.runtime.base import ReplicaHandle
    from fleet_base.models import DiskFull
    from fleet_base.protocol import LoRAAdapterSpec, ReplicaSpec, ReplicaState

    adapter, other = os.urandom(300_000), os.urandom(300_000)
    with serve(FileServer({"adapter.safetensors": adapter, "other.gguf": other}).app()) as base:
        adapter_uri = f"{base}/adapter.safetensors#sha256={hashlib.sha256(adapter).hexdigest()}"
        other_uri = f"{base}/other.gguf#sha256={hashlib.sha256(other).hexdigest()}"
        root, bound = tmp_path / "cache", 500_000
        # The replica process pulls its adapter (engine.server.lora.adapter_dir does this).
        ModelCache(root, bound).pull(adapter_uri, in_use=[adapter_uri])

        puller = ModelPuller(ModelCache(root, bound))
        spec = ReplicaSpec(
            replica_id="r1", deployment="d", version=1, model="smollm2-135m", max_adapters=2,
            adapters=[LoRAAdapterSpec(name="tenant-a", uri=adapter_uri)],
        )  # fmt: skip
        replica = Replica(
            spec=spec,
            state=ReplicaState.ready,
            handle=ReplicaHandle(replica_id="r1", spec=spec, url="http://r1"),
        )
        controller = AdapterController(
            api=_LoadedAdapters(["tenant-a"]),  # type: ignore[arg-type]
            replicas=lambda: {"r1": replica},
            desired=lambda: None,
            interval_s=1.0,
            on_in_use=puller.use_adapters,
        )
        await controller.sync([replica])
        assert replica.adapters == ["tenant-a"]

        # Another replica process pulls a model that only fits if something is evicted.
        with pytest.raises(DiskFull, match="replicas use"):
            ModelCache(root, bound).pull(other_uri, in_use=[other_uri])
        entry = ModelCache(root).lookup(adapter_uri)
        assert entry is not None and all(
            (ModelCache(root).model_dir(entry) / f.name).is_file() for f in entry.files
        )
        assert [m.in_use for m in puller.report() if m.uri == entry.uri] == [True]
        refused = await puller.command(ModelCommand(action="rm", uri=adapter_uri))
        assert not refused.ok and "in use" in refused.message

        # Once no replica holds it, it may go.
        replica.adapters = []
        controller.api = _LoadedAdapters([])  # type: ignore[assignment]
        await controller.sync([replica])
        ModelCache(root, bound).pull(other_uri, in_use=[other_uri])
        assert ModelCache(root).lookup(adapter_uri) is None
