"""Nodes where replicas run, learned from heartbeats: their health, their failure record,
and operators' cordons. A cordon or uncordon is stored as the node's latest action and
published to the cluster's agent in its DesiredState (`node_actions`); the agent applies
it, and its next heartbeat shows the node's new state (docs/health.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Path, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.api.audit import audit, event
from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, kick, where_equal
from control_plane.api.errors import ApiError
from control_plane.api.schemas import NodeActionIn, NodeDetailOut, NodeOut, Page
from control_plane.db.models import Node, utcnow
from control_plane.nodes.views import node_detail, nodes_out
from fleet_base.node_health import NODE_NAME_MAX, NODE_NAME_PATTERN, NodeState

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])

ClusterPath = Annotated[str, Path(min_length=1, max_length=63, description="the cluster id")]
NodePath = Annotated[
    str, Path(min_length=1, max_length=NODE_NAME_MAX, pattern=NODE_NAME_PATTERN, description="the node")
]


def _load(session: Session, cluster: str, node: str) -> Node:
    row = session.scalar(select(Node).where(Node.cluster == cluster, Node.node == node))
    if row is None:
        raise ApiError(
            404,
            f"node {node!r} of cluster {cluster!r} not found: nodes are known once their cluster's agent "
            "reports them in a heartbeat",
        )
    return row


@router.get("", response_model=Page[NodeOut])
def list_nodes(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    cluster: str | None = Query(None, max_length=63),
    state: NodeState | None = Query(None),
):
    """Every known node (by cluster, then name), optionally of one cluster or state."""
    query = where_equal(
        select(Node).order_by(Node.cluster, Node.node),
        (Node.cluster, cluster),
        (Node.state, state.value if state is not None else None),
    )
    rows, total = page.apply(session, query)
    return Page(items=nodes_out(session, rows), total=total, limit=page.limit, offset=page.offset)


@router.get("/{cluster}/{node}", response_model=NodeDetailOut)
def get_node(
    cluster: ClusterPath,
    node: NodePath,
    session: SessionDep,
    who: PrincipalDep,
    faults: int = Query(50, ge=0, le=1000, description="how many of its latest faults"),
):
    """The node and its latest faults (every kind; `node_fault` says which count)."""
    return node_detail(session, _load(session, cluster, node), faults)


def _act(
    action: Literal["cordon", "uncordon"],
    cluster: str,
    node: str,
    body: NodeActionIn | None,
    request: Request,
    session: Session,
    who,
) -> NodeOut:
    row = _load(session, cluster, node)
    before = nodes_out(session, [row])[0]
    reason = body.reason if body is not None else ""
    row.action, row.action_at, row.action_reason, row.action_by = action, utcnow(), reason, who.actor[:200]
    session.flush()
    after = nodes_out(session, [row])[0]
    audit(session, who, f"node.{action}", "node", f"{cluster}/{node}"[:128], before, after)
    event(
        session,
        "node_action",
        f"{node}: {action} by {who.actor}" + (f" ({reason})" if reason else "") + "; sent to the agent",
        cluster=cluster,
    )
    session.commit()
    kick(request)  # the reconcile loop publishes the cluster's desired state with it
    return after


@router.post("/{cluster}/{node}/cordon", response_model=NodeOut)
def cordon_node(
    cluster: ClusterPath,
    node: NodePath,
    request: Request,
    session: SessionDep,
    who: PrincipalDep,
    body: Annotated[NodeActionIn | None, Body()] = None,
):
    """No new replicas on the node; the agent moves the ones there away and withholds
    its capacity until an uncordon."""
    return _act("cordon", cluster, node, body, request, session, who)


@router.post("/{cluster}/{node}/uncordon", response_model=NodeOut)
def uncordon_node(
    cluster: ClusterPath,
    node: NodePath,
    request: Request,
    session: SessionDep,
    who: PrincipalDep,
    body: Annotated[NodeActionIn | None, Body()] = None,
):
    """Back into service (remediated: healthy again after a clean probe), whoever
    cordoned it."""
    return _act("uncordon", cluster, node, body, request, session, who)
