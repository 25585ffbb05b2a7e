"""The residency rule (`fleet_base.residency`): intersection of policies, fail-closed
permits, and the parsers behind `--residency` and `--jurisdictions`."""

from __future__ import annotations

import pytest

from fleet_base.api_keys import ApiKeyRecord
from fleet_base.protocol import ClusterRoute, DesiredState, RoutingTable, UsageRecord
from fleet_base.residency import allowed, describe, parse_jurisdictions, parse_residency, permits


@pytest.mark.parametrize(
    ("policies", "expected"),
    [
        ((), None),
        ((None,), None),
        ((None, None), None),
        ((["ca"],), frozenset({"ca"})),
        ((["ca", "us"], None), frozenset({"ca", "us"})),
        ((None, ["eu"]), frozenset({"eu"})),
        ((["ca", "us"], ["us", "eu"]), frozenset({"us"})),
        ((["ca"], ["us"]), frozenset()),  # disjoint: nothing allowed
        (([],), frozenset()),
        ((["ca", "us"], ["ca", "us"], ["us"]), frozenset({"us"})),
    ],
)
def test_allowed_is_the_intersection_of_set_policies(policies, expected):
    assert allowed(*policies) == expected


@pytest.mark.parametrize(
    ("policy", "jurisdiction", "expected"),
    [
        (None, "ca", True),
        (None, "", True),  # no policy: a region without a jurisdiction serves
        (frozenset({"ca"}), "ca", True),
        (frozenset({"ca"}), "us", False),
        (frozenset({"ca"}), "", False),  # no jurisdiction is outside every policy
        (frozenset({"ca", "us"}), "us", True),
        (frozenset(), "ca", False),  # empty intersection: fail closed
        (frozenset(), "", False),
    ],
)
def test_permits_fails_closed(policy, jurisdiction, expected):
    assert permits(policy, jurisdiction) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("ca", ["ca"]),
        ("ca,us", ["ca", "us"]),
        (" CA , us ", ["ca", "us"]),
        ("ca,ca,us", ["ca", "us"]),
        (["eu", "ca-qc"], ["eu", "ca-qc"]),
        ("x" * 32, ["x" * 32]),
    ],
)
def test_parse_residency(value, expected):
    assert parse_residency(value) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty"),
        ([], "at least one"),
        ("ca,", "empty"),
        ("c a", "not a label"),
        ("ca_east", "not a label"),
        ("x" * 33, "not a label"),
        ("é", "not a label"),
        ([1], "must be a string"),
        (["a"] * 65, "at most"),
    ],
)
def test_parse_residency_refuses_with_a_reason(value, reason):
    with pytest.raises(ValueError, match=reason):
        parse_residency(value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("local-east=ca", {"local-east": "ca"}),
        ("local-east=ca,local-west=us", {"local-east": "ca", "local-west": "us"}),
        (" local-east = CA , local-west=us ", {"local-east": "ca", "local-west": "us"}),
    ],
)
def test_parse_jurisdictions(text, expected):
    assert parse_jurisdictions(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no CLUSTER=JURISDICTION"),
        ("local-east", "not CLUSTER=JURISDICTION"),
        ("local-east=ca,,local-west=us", "empty entry"),
        ("Local_East=ca", "not a cluster id"),
        ("local-east=ca,local-east=us", "twice"),
        ("local-east=", "empty"),
        ("local-east=c a", "not a label"),
    ],
)
def test_parse_jurisdictions_refuses_with_a_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_jurisdictions(text)


def test_describe():
    assert describe(None) == "any"
    assert describe(frozenset()) == "none"
    assert describe(["us", "ca"]) == "ca, us"


def test_wire_fields_default_to_no_policy_and_round_trip():
    """Older writers omit the fields (no jurisdiction, no policy); newer ones carry them."""
    assert ClusterRoute(cluster="a").jurisdiction == ""
    assert RoutingTable(deployment="d").residency is None
    assert DesiredState(cluster="a").jurisdiction == ""
    usage = UsageRecord(cluster="a", key_id="k", deployment="d")
    assert (usage.region, usage.jurisdiction) == ("", "")
    key = ApiKeyRecord(key_id="k", name="n", salt="s", hash="h")
    assert key.residency is None

    table = RoutingTable(
        deployment="d",
        residency=["ca"],
        clusters=[ClusterRoute(cluster="a", jurisdiction="ca")],
        by_region={"r": [ClusterRoute(cluster="a", jurisdiction="ca")]},
    )
    again = RoutingTable.from_bytes(table.to_bytes())
    assert again.residency == ["ca"]
    assert again.by_region["r"][0].jurisdiction == "ca"
    bound = ApiKeyRecord.from_bytes(key.model_copy(update={"residency": ["ca", "us"]}).to_bytes())
    assert bound.residency == ["ca", "us"]
    record = UsageRecord.from_bytes(
        usage.model_copy(update={"region": "ca-east", "jurisdiction": "ca"}).to_bytes()
    )
    assert (record.region, record.jurisdiction) == ("ca-east", "ca")
