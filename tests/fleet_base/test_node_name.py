"""The local node name: the configured one, else the host name reduced to a NodeName."""

from __future__ import annotations

import platform

import pytest
from pydantic import TypeAdapter, ValidationError

from fleet_base.cluster_config import ClusterConfig
from fleet_base.node_health import NodeName, local_node_name


@pytest.mark.parametrize(
    ("configured", "hostname", "expected"),
    [
        ("gpu-node-7", "ignored", "gpu-node-7"),
        ("", "worker-1.example.com", "worker-1.example.com"),
        ("", "My Laptop (2)", "My-Laptop--2-"),
        ("", "_-.host_name", "host_name"),
        ("", "", "localhost"),
        ("", "___", "localhost"),
        ("", "a" * 300, "a" * 253),
        ("", "höst", "h-st"),
    ],
)
def test_local_node_name(configured: str, hostname: str, expected: str) -> None:
    name = local_node_name(configured, hostname=hostname)
    assert name == expected
    TypeAdapter(NodeName).validate_python(name)  # always a valid NodeName


def test_local_node_name_defaults_to_this_host() -> None:
    assert local_node_name("") == local_node_name("", hostname=platform.node())


def test_cluster_config_node_name() -> None:
    assert ClusterConfig(cluster="c1").node_name == ""
    assert ClusterConfig(cluster="c1", node_name="n-1").node_name == "n-1"
    with pytest.raises(ValidationError):
        ClusterConfig(cluster="c1", node_name="bad name")
