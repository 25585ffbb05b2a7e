"""The console's control-plane card: members leader first, the leader and its epoch, from the
answer of `GET /v1/control-plane` (a recorded one, per its JSON contract) as the API's own route
function gives it, however that function answers (a dict, a model or a response)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from control_plane.console import data
from control_plane.console.pages import _control_plane_view
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


def test_no_leader_and_no_route_are_said_plainly():
    assert "no leader" in _card({**VIEW, "leader": None, "members": []})
    assert "does not report its instances" in _card(None)


class Out(BaseModel):
    leader: str | None
    epoch: int
    members: list[dict]
    is_leader: bool


def _request(app: FastAPI) -> Request:
    return Request({"type": "http", "app": app, "method": "GET", "path": "/console/", "headers": []})


@pytest.mark.parametrize(
    "answer",
    [
        lambda request: VIEW,
        lambda request: Out(**VIEW),
        lambda request: JSONResponse(VIEW),
    ],
)
@pytest.mark.parametrize("is_async", [False, True])
def test_the_view_comes_from_the_apis_own_route(answer, is_async):
    app = FastAPI()
    if is_async:

        async def route(request: Request):
            return answer(request)
    else:

        def route(request: Request):
            return answer(request)

    app.get("/v1/control-plane")(route)
    view = asyncio.run(_control_plane_view(_request(app)))
    assert view["leader"] == "cp-b" and view["epoch"] == 7 and len(view["members"]) == 2
    assert asyncio.run(_control_plane_view(_request(FastAPI()))) is None
