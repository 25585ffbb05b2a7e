"""What a pod's status says about its replica: pure (pod dict in, `PodView` out), so the
table of pod states is tested without a cluster.

- Pending and `PodScheduled=False/Unschedulable`: starting, but the cluster lacks the
  capacity the pool claimed (the agent reports it so the control plane re-places);
- a container waiting on `ImagePullBackOff`, `ErrImagePull`, `InvalidImageName`,
  `CreateContainerConfigError`, `CreateContainerError`: failed (the image or config is
  wrong; the agent retries with its backoff);
- Running and `Ready=True`: ready; Running otherwise: starting (loading, or a blip);
- terminating (deletionTimestamp) that the agent did not ask for: draining;
- Failed / Succeeded: failed, with the container's exit code and reason (`OOMKilled`,
  `Error`, a startup probe that ran out); the node going away under a spot pool
  (kubelet graceful shutdown, the taint manager, pod GC of a deleted node) is
  `preempted`, which the control plane answers by re-placing at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet_base.protocol import ReplicaState

FAILED_WAITING = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)
# DisruptionTarget reasons and pod status reasons that mean "the node went away".
NODE_LOSS_DISRUPTIONS = frozenset({"TerminationByKubelet", "DeletionByTaintManager", "DeletionByPodGC"})
NODE_LOSS_REASONS = frozenset({"Terminated", "Shutdown", "NodeShutdown", "NodeLost"})


@dataclass(frozen=True)
class PodView:
    state: ReplicaState
    error: str = ""
    exit_code: int | None = None
    preempted: bool = False
    unschedulable: bool = False
    pod_ip: str = ""


def _conditions(pod: dict) -> dict[str, dict]:
    return {c.get("type", ""): c for c in (pod.get("status") or {}).get("conditions") or []}


def _container(pod: dict) -> dict:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return statuses[0] if statuses else {}


def node_lost(pod: dict) -> bool:
    status = pod.get("status") or {}
    disruption = _conditions(pod).get("DisruptionTarget", {})
    if disruption.get("status") == "True" and disruption.get("reason") in NODE_LOSS_DISRUPTIONS:
        return True
    return status.get("reason") in NODE_LOSS_REASONS


def is_spot(pod: dict) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get("fleet.dev/tier") == "spot"


def _terminated(pod: dict, memory_limit: str) -> tuple[str, int | None]:
    term = (_container(pod).get("state") or {}).get("terminated") or {}
    status = pod.get("status") or {}
    code = term.get("exitCode")
    reason = term.get("reason") or status.get("reason") or "exited"
    parts = [f"{reason}" + (f" (exit code {code})" if code is not None else "")]
    if reason == "OOMKilled":
        parts.append(f"the replica ran out of its {memory_limit} memory limit")
    for text in (term.get("message"), status.get("message")):
        if text:
            parts.append(str(text).strip()[-1000:])
    return "; ".join(parts), code


def classify(pod: dict, memory_limit: str = "") -> PodView:
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    ip = status.get("podIP", "") or ""
    if phase in ("Failed", "Succeeded"):
        error, code = _terminated(pod, memory_limit)
        lost = node_lost(pod)
        if lost:
            error = f"node lost: {error}"
        return PodView(ReplicaState.failed, error, code, preempted=lost and is_spot(pod), pod_ip=ip)
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return PodView(ReplicaState.draining, "pod is terminating", pod_ip=ip)
    waiting = (_container(pod).get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in FAILED_WAITING:
        message = waiting.get("message") or ""
        return PodView(ReplicaState.failed, f"{waiting['reason']}: {message}".strip(": "), pod_ip=ip)
    conds = _conditions(pod)
    scheduled = conds.get("PodScheduled", {})
    if (
        phase == "Pending"
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
    ):
        return PodView(
            ReplicaState.starting,
            f"Unschedulable: {scheduled.get('message', '')}".strip(),
            unschedulable=True,
        )
    if phase == "Running" and conds.get("Ready", {}).get("status") == "True":
        return PodView(ReplicaState.ready, pod_ip=ip)
    return PodView(ReplicaState.starting, pod_ip=ip)


def vanished(pod: dict | None) -> PodView:
    """The pod is gone and the agent did not delete it: its node was deleted (a spot
    reclaim on most clouds) or someone deleted the pod."""
    spot = pod is not None and is_spot(pod)
    why = (
        "node lost: pod deleted by the cluster (its node was removed)"
        if spot
        else "pod deleted outside the agent"
    )
    return PodView(ReplicaState.failed, why, preempted=spot)
