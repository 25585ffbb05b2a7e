"""How a deployment's spec is completed on create and merged on update: plain functions
over dicts, no database, so the rules are easy to read and to test.

- `replicas` alone pins the count (min = max = replicas); min/max give an autoscaled
  range and `replicas` defaults into it.
- A model URI is checked and stored canonical, an hf:// revision pinned (`model_refs`).
- An update merges the given fields onto the current version; if any version field
  changes the result is a new version, while `replicas` alone only scales.
- The engine must be able to run the version (`fleet_base.engines.deployment_problems`), and
  `gpu_count` follows the engine's tensor x pipeline parallel sizes where `engine_args` give
  them (a different `gpu_count` given with them is refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from control_plane.api.errors import invalid
from control_plane.api.model_refs import model_ref
from control_plane.api.schemas import (
    AdapterFields,
    DeploymentCreate,
    DeploymentUpdate,
    PolicyFields,
    ResidencyFields,
)
from control_plane.rollouts.surge import DEFAULT_MAX_SURGE, DEFAULT_MAX_UNAVAILABLE
from fleet_base.engines import deployment_problems, parallel_args, parallel_gpus

VERSION_DEFAULTS: dict[str, Any] = {
    "engine": "fleet",
    "engine_args": {},
    "gpu_models": [],
    "gpu_count": 1,
    "gpu_memory_gb": 0.0,
    "autoscale_window_s": 60.0,
    "scale_down_delay_s": None,  # derived from the cold start (control_plane.autoscale.policy)
    "target_concurrency": 8.0,
    "scale_to_zero": False,
    "slo_ttft_s": None,
    "slo_itl_s": None,
    "regions": [],
    "min_regions": 1,
    "standby_regions": [],
}
VERSION_FIELDS = ("model", "min_replicas", "max_replicas", *VERSION_DEFAULTS)
# Version fields whose default is null: an explicit null in an update sets them back to it
# (elsewhere a null means "unchanged").
RESETTABLE = ("scale_down_delay_s",)


def _given(body: PolicyFields) -> dict[str, Any]:
    return {k: v for k, v in body.model_dump(exclude_unset=True).items() if v is not None}


def _bounds(given: dict[str, Any], replicas: int | None, scale_to_zero: bool) -> tuple[int, int]:
    lo, hi = given.get("min_replicas"), given.get("max_replicas")
    if lo is None and hi is None:
        pinned = 1 if replicas is None else replicas
        return pinned, pinned
    if lo is None:
        lo = 0 if scale_to_zero else min(1, hi)
    if hi is None:
        hi = max(lo, replicas if replicas is not None else lo, 1)
    return lo, hi


def check_engine(spec: dict[str, Any], adapters: int) -> None:
    """The version can run on its engine with `adapters` LoRA adapters on the deployment."""
    problems = deployment_problems(spec["engine"], spec["model"], spec["engine_args"], adapters=adapters)
    if problems:
        raise invalid(problems[0].field, "; ".join(p.reason for p in problems))


def _replica_gpus(spec: dict[str, Any], given: dict[str, Any], current: dict[str, Any] | None = None) -> None:
    """Set `gpu_count` from the engine's parallel sizes, if `engine_args` give any. A
    `gpu_count` that came from them is not carried onto a version that gives none."""
    if not parallel_args(spec["engine"], spec["engine_args"]):
        if current is not None and "gpu_count" not in given and _parallel(current):
            spec["gpu_count"] = VERSION_DEFAULTS["gpu_count"]
        return
    gpus = parallel_gpus(spec["engine"], spec["engine_args"])
    if "gpu_count" in given and given["gpu_count"] != gpus:
        raise invalid(
            "gpu_count",
            f"{given['gpu_count']} GPUs per replica disagrees with {spec['engine']}'s parallel sizes in "
            f"engine_args ({gpus} GPUs per replica); leave gpu_count out, it follows them",
        )
    spec["gpu_count"] = gpus


def check_node_fit(spec: dict[str, Any], pools: Sequence[Any]) -> None:
    """A replica spread over GPUs by the engine's parallel sizes must fit one node of a pool
    whose GPUs it accepts (placement never splits a replica over nodes): refused here rather
    than left unplaced. With no pools registered yet nothing is known, so nothing is refused."""
    gpus = spec["gpu_count"]
    if gpus <= 1 or not _parallel(spec) or not pools:
        return
    wanted = {m.lower() for m in spec["gpu_models"]}
    matching = [
        p
        for p in pools
        if (not wanted or p.gpu_model.lower() in wanted) and p.gpu_memory_gb >= spec["gpu_memory_gb"]
    ]
    if any(p.gpus_per_node >= gpus for p in matching):
        return
    largest = max((p.gpus_per_node for p in matching), default=0)
    where = f"the largest node of a matching pool has {largest}" if matching else "no pool matches gpu_models"
    raise invalid(
        "engine_args",
        f"{spec['engine']}'s parallel sizes need {gpus} GPUs per replica on one node, but {where}; "
        "lower tensor_parallel_size (or pipeline_parallel_size), or add a pool with larger nodes",
    )


def adapters_after(dep: Any, body: AdapterFields | None = None) -> int:
    """How many LoRA adapters the deployment has once `body` (if any) is applied."""
    given = getattr(body, "adapters", None)
    return len(given) if given is not None else len(getattr(dep, "adapters", None) or [])


def _parallel(spec: dict[str, Any]) -> bool:
    """The version's GPU count came from its engine's parallel sizes."""
    return bool(parallel_args(spec.get("engine") or "fleet", spec.get("engine_args") or {}))


def check_spec(spec: dict[str, Any], replicas: int) -> None:
    """Cross-field rules a single field's validation cannot see."""
    lo, hi = spec["min_replicas"], spec["max_replicas"]
    if lo > hi:
        raise invalid("min_replicas", f"{lo} is greater than max_replicas ({hi})")
    if not lo <= replicas <= hi:
        raise invalid(
            "replicas", f"replicas ({replicas}) must be within min_replicas..max_replicas ({lo}..{hi})"
        )
    regions = spec["regions"]
    both = sorted(set(regions) & set(spec.get("standby_regions") or []))
    if both:
        raise invalid("standby_regions", f"{', '.join(both)} cannot be both a serving and a standby region")
    if regions and spec["min_regions"] > len(regions):
        raise invalid("min_regions", f"{spec['min_regions']} exceeds the {len(regions)} allowed region(s)")


def new_spec(body: DeploymentCreate) -> tuple[dict[str, Any], int]:
    """(version fields, desired replicas) of a new deployment."""
    given = _given(body)
    spec = {**VERSION_DEFAULTS, **{k: v for k, v in given.items() if k in VERSION_FIELDS}}
    spec["model"] = model_ref(spec["model"])
    check_engine(spec, len(body.adapters or []))
    _replica_gpus(spec, given)
    lo, hi = _bounds(given, given.get("replicas"), spec["scale_to_zero"])
    spec["min_replicas"], spec["max_replicas"] = lo, hi
    replicas = given.get("replicas")
    if replicas is None:
        replicas = min(max(1, lo), hi)
    check_spec(spec, replicas)
    return spec, replicas


def merged_spec(
    current: dict[str, Any], replicas: int, body: DeploymentUpdate, adapters: int = 0
) -> tuple[dict[str, Any], int]:
    """(version fields, desired replicas) after an update; compare with `current` to see
    whether it makes a new version. Replicas outside new bounds are clamped into them
    unless given explicitly (then it is an error). `adapters`: the deployment's LoRA
    adapters after the update."""
    given = _given(body)
    reset = {k: None for k in RESETTABLE if k in body.model_fields_set and getattr(body, k) is None}
    spec = {**current, **{k: v for k, v in given.items() if k in VERSION_FIELDS}, **reset}
    if "model" in given and given["model"] != current.get("model"):
        spec["model"] = model_ref(spec["model"])
    check_engine(spec, adapters)
    _replica_gpus(spec, given, current)
    lo, hi = spec["min_replicas"], spec["max_replicas"]
    if "replicas" in given:
        new_replicas = given["replicas"]
    else:
        new_replicas = min(max(replicas, lo), hi) if lo <= hi else replicas
    check_spec(spec, new_replicas)
    return spec, new_replicas


POLICY_FIELDS = ("priority", "max_surge", "max_unavailable")


def apply_policy(dep: Any, body: PolicyFields) -> list[str]:
    """Set the deployment's unversioned fields that `body` gives; the changes, described.
    A surge budget of 0 with 0 unavailable could never roll out, so it is refused."""
    given = {k: v for k, v in _given(body).items() if k in POLICY_FIELDS}
    surge = given.get("max_surge", getattr(dep, "max_surge", None) or DEFAULT_MAX_SURGE)
    unavailable = given.get(
        "max_unavailable", getattr(dep, "max_unavailable", None) or DEFAULT_MAX_UNAVAILABLE
    )
    if float(surge.rstrip("%")) == 0 and float(unavailable.rstrip("%")) == 0:
        raise invalid(
            "max_unavailable", "max_surge and max_unavailable cannot both be 0: no rollout could progress"
        )
    changes = []
    for field, value in given.items():
        if getattr(dep, field, None) != value:
            changes.append(f"{field} {getattr(dep, field, None)} -> {value}")
            setattr(dep, field, value)
    return changes


def apply_residency(dep: Any, body: ResidencyFields) -> list[str]:
    """Set the deployment's residency policy when `body` names one (null clears it); the
    change, described. Unversioned: placement moves replicas, no rollout is needed."""
    if "residency" not in body.model_fields_set:
        return []
    old = getattr(dep, "residency", None)
    if old == body.residency:
        return []
    dep.residency = body.residency
    return [f"residency {_policy(old)} -> {_policy(body.residency)}"]


def _policy(value: list[str] | None) -> str:
    return "any" if value is None else ",".join(value)


def version_fields(row: Any) -> dict[str, Any]:
    return {field: getattr(row, field) for field in VERSION_FIELDS}
