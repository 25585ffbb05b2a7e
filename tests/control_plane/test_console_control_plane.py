"""The console's control-plane card: members leader first, the leader and its epoch, from a
recorded answer of `GET /v1/control-plane` (its JSON contract). The card on a live control
plane, through the route's own function: tests/control_plane/test_console.py."""

from __future__ import annotations

from control_plane.console import data
from control_plane.console.web import templates
from tests.control_plane.test_control_plane_status_cli import VIEW


def _card(view) -> str:
    return templates.env.get_template("_control_plane.html").render(cp=data.control_plane(view))


def test_the_card_shows_members_leader_first_and_the_epoch():
    html = _card(VIEW)
    assert "Leader <strong>cp-b</strong>, epoch <strong>7</strong>" in html
    assert html.index('data-member="cp-b"') < html.index('data-member="cp-a"')
    leader_row = html[html.index('data-member="cp-b"') :].split("</tr>")[0]
    assert (
        "leader" in leader_row
        and "2026-12-04 20:00:02" in leader_row
        and "http://10.0.0.2:7070" in leader_row
    )
    assert "follower" in html.split('data-member="cp-a"')[1].split("</tr>")[0]
    assert "no leader" not in html


def test_no_leader_is_said_plainly():
    html = _card({**VIEW, "leader": None, "members": []})
    assert "no leader" in html and "No instances recorded yet" in html
