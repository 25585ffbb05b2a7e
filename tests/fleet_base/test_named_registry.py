"""The one name -> factory registry helper that placers and policies use."""

import pytest

from control_plane.autoscale import make_policy as make_autoscale
from control_plane.placement import get_placer, placer_names
from fleet_base.named_registry import Registry


def test_registers_builds_and_refuses_unknown_names_with_the_known_ones() -> None:
    reg: Registry[list] = Registry("widget", {"b": list})
    reg.register("a", lambda: [1])
    assert reg.names() == ["a", "b"] and "a" in reg and len(reg) == 2
    assert reg.make("a") == [1] and reg.make("a") is not reg.make("a")
    with pytest.raises(ValueError, match=r"unknown widget 'c'; known: a, b"):
        reg.make("c")


def test_placers_and_policies_share_it() -> None:
    assert {"ffd", "milp"} <= set(placer_names())
    with pytest.raises(ValueError, match="unknown placer 'x'"):
        get_placer("x")
    with pytest.raises(ValueError, match="unknown autoscaling policy 'x'"):
        make_autoscale("x")
    assert make_autoscale("static") is not None
