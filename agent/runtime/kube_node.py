"""Cordoning a Kubernetes node for Fleet, pure (Node dict in, JSON merge patch out), so the
table of node states is tested without a cluster.

- cordon: `spec.unschedulable: true` (what `kubectl cordon` sets) and Fleet's taint
  `fleet.dev/unhealthy=<kind>:NoSchedule`, which says why in `kubectl describe node` and
  keeps it off the scheduler's list even if someone uncordons it by hand. NoSchedule, not
  NoExecute: NoExecute would evict every pod on the node at once, other teams' included;
  Fleet moves its own replicas (`recycle_node`) with their drain grace. The full reason
  goes in the annotation `fleet.dev/cordon-reason`.
- uncordon: removes only Fleet's taint (never another's: the node controller's, an
  admin's) and sets the node schedulable again only if Fleet made it unschedulable; a node
  an admin had already cordoned stays cordoned. Which it was is in the annotation
  `fleet.dev/cordoned` ("unschedulable": Fleet set it; "kept": it was so already).

Taints are a list, which a merge patch replaces whole, so every patch carries the
resourceVersion it was computed from: a concurrent writer makes it a 409 Conflict and the
runtime reads the node again (optimistic concurrency, as controllers do).
"""

from __future__ import annotations

import re

from agent.runtime.kube_pod import LABEL

TAINT_KEY = f"{LABEL}/unhealthy"
TAINT_EFFECT = "NoSchedule"
REASON_ANNOTATION = f"{LABEL}/cordon-reason"
CORDONED_ANNOTATION = f"{LABEL}/cordoned"
MAX_REASON = 1024
DEFAULT_TAINT_VALUE = "fault"


def taint_value(reason: str) -> str:
    """The taint's value: the reason's first word (the fault kind, as the agent writes its
    reasons: "xid 79 on GPU 3" -> "xid"), reduced to a label value (63 characters,
    alphanumeric at both ends)."""
    first = (re.split(r"[\s:;,]+", reason.strip(), maxsplit=1) or [""])[0]
    value = re.sub(r"[^A-Za-z0-9_.\-]", "-", first)[:63].strip("-_.")
    return value or DEFAULT_TAINT_VALUE


def fleet_taint(reason: str) -> dict[str, str]:
    return {"key": TAINT_KEY, "value": taint_value(reason), "effect": TAINT_EFFECT}


def _parts(node: dict) -> tuple[dict, dict, list[dict]]:
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    return meta, spec, list(spec.get("taints") or [])


def _patch(meta: dict, annotations: dict, spec: dict) -> dict:
    return {
        "metadata": {"resourceVersion": meta.get("resourceVersion", ""), "annotations": annotations},
        "spec": spec,
    }


def is_fleet_cordoned(node: dict) -> bool:
    meta, _, taints = _parts(node)
    return CORDONED_ANNOTATION in (meta.get("annotations") or {}) or any(
        t.get("key") == TAINT_KEY for t in taints
    )


def cordon_patch(node: dict, reason: str) -> dict | None:
    """The merge patch that cordons `node` for `reason`; None when it already is (so a
    repeated cordon writes nothing)."""
    meta, spec, taints = _parts(node)
    annotations = meta.get("annotations") or {}
    reason = reason[:MAX_REASON]
    taint = fleet_taint(reason)
    others = [t for t in taints if t.get("key") != TAINT_KEY]
    mark = annotations.get(CORDONED_ANNOTATION) or ("kept" if spec.get("unschedulable") else "unschedulable")
    done = (
        spec.get("unschedulable") is True
        and taint in taints
        and len(others) == len(taints) - 1
        and annotations.get(REASON_ANNOTATION) == reason
        and annotations.get(CORDONED_ANNOTATION) == mark
    )
    if done:
        return None
    return _patch(
        meta,
        {REASON_ANNOTATION: reason, CORDONED_ANNOTATION: mark},
        {"unschedulable": True, "taints": [*others, taint]},
    )


def uncordon_patch(node: dict) -> dict | None:
    """The merge patch that undoes Fleet's cordon of `node` (and nothing else); None when
    Fleet has nothing on it."""
    if not is_fleet_cordoned(node):
        return None
    meta, _, taints = _parts(node)
    annotations = meta.get("annotations") or {}
    spec: dict = {"taints": [t for t in taints if t.get("key") != TAINT_KEY] or None}
    if annotations.get(CORDONED_ANNOTATION) == "unschedulable":
        spec["unschedulable"] = None  # the default, false
    return _patch(meta, {REASON_ANNOTATION: None, CORDONED_ANNOTATION: None}, spec)
