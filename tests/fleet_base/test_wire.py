"""One decode per wire message kind: the same checks wherever a kind is read."""

import json

import pytest

from fleet_base import protocol
from fleet_base.wire import Rejected, decode, decode_demand, decode_event, decode_heartbeat, decode_usage


def usage(**change) -> protocol.UsageRecord:
    values = {"cluster": "east", "key_id": "k", "deployment": "web", "version": 1, "status": 200}
    return protocol.UsageRecord(**(values | change))


@pytest.mark.parametrize(
    ("decoder", "subject", "data", "reason"),
    [
        (decode_heartbeat, protocol.heartbeat_subject("east"), b"{not json", "malformed"),
        (decode_heartbeat, protocol.heartbeat_subject("east"), b'{"cluster": "east", "schema_version": 2}', "schema"),
        (decode_heartbeat, protocol.heartbeat_subject("east"), protocol.Heartbeat(cluster="west").to_bytes(), "subject"),
        (decode_heartbeat, protocol.heartbeat_subject("EAST"), protocol.Heartbeat(cluster="EAST").to_bytes(), "invalid"),
        (decode_demand, protocol.demand_subject("east"), protocol.Demand(cluster="west", deployment="d").to_bytes(), "subject"),
        (decode_event, protocol.events_subject("east"), protocol.Event(cluster="west", kind="info").to_bytes(), "subject"),
        (decode_usage, protocol.usage_subject("east"), usage(cluster="west").to_bytes(), "subject"),
        (decode_usage, protocol.usage_subject("east"), usage(key_id="k" * 40).to_bytes(), "invalid"),
    ],
)  # fmt: skip
def test_refusals_name_their_reason(decoder, subject, data, reason) -> None:
    with pytest.raises(Rejected) as err:
        decoder(subject, data)
    assert err.value.reason == reason


def test_accepted_messages_come_back_typed() -> None:
    hb = decode_heartbeat(protocol.heartbeat_subject("east"), protocol.Heartbeat(cluster="east").to_bytes())
    assert isinstance(hb, protocol.Heartbeat) and hb.cluster == "east"
    assert decode_usage(protocol.usage_subject("east"), usage().to_bytes()).deployment == "web"
    # a bucket entry has no subject to check
    state = protocol.DesiredState(cluster="east", generation=3).to_bytes()
    assert decode(protocol.DesiredState, "east", state, subject_for=None).generation == 3


def test_shadow_fields_default_off_and_round_trip() -> None:
    """Older writers omit the shadow fields (no shadow, an ordinary record); newer ones carry them."""
    assert protocol.RoutingTable(deployment="web").shadow is None
    plain = usage()
    assert (plain.shadow, plain.shadow_of, plain.itl_s, plain.greedy_match, plain.first_diff_token) == (
        False,
        None,
        None,
        None,
        None,
    )
    table = protocol.RoutingTable(deployment="web", shadow=protocol.ShadowTarget(version=2, share=0.1))
    assert protocol.RoutingTable.from_bytes(table.to_bytes()).shadow == protocol.ShadowTarget(
        version=2, share=0.1
    )
    copy = usage(shadow=True, shadow_of="abc", itl_s=0.02, greedy_match=False, first_diff_token=7)
    back = decode_usage(protocol.usage_subject("east"), copy.to_bytes())
    assert (back.shadow, back.shadow_of, back.itl_s, back.greedy_match, back.first_diff_token) == (
        True,
        "abc",
        0.02,
        False,
        7,
    )


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, float("nan")])
def test_shadow_share_must_be_a_fraction(share) -> None:
    with pytest.raises(ValueError):
        protocol.ShadowTarget(version=2, share=share)


def test_shadow_usage_is_bounded() -> None:
    with pytest.raises(Rejected) as err:
        data = usage(shadow=True).model_dump(mode="json") | {"shadow_of": "x" * 65}
        decode_usage(protocol.usage_subject("east"), json.dumps(data).encode())
    assert err.value.reason == "malformed"
