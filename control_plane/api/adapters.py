"""A deployment's LoRA adapters: the catalog (name -> model URI) and `max_adapters` per
replica. Unversioned: changing them never starts a rollout; agents load and unload
adapters on running replicas. Adapter URIs are checked and pinned like model URIs."""

from __future__ import annotations

from typing import Any

from control_plane.api.errors import invalid
from control_plane.api.model_refs import model_ref
from control_plane.api.schemas import AdapterFields, AdapterIn
from fleet_base.protocol import DEFAULT_MAX_ADAPTERS


def adapter_record(adapter: AdapterIn) -> dict[str, str]:
    try:
        uri = model_ref(adapter.uri)
    except Exception as err:  # model_ref raises the API's 422 for "model"; name the adapter
        message = getattr(err, "message", str(err))
        raise invalid("adapters", f"{adapter.name}: {message}") from None
    return {"name": adapter.name, "uri": uri}


def apply_adapters(dep: Any, body: AdapterFields) -> list[str]:
    """Set the adapters and max_adapters `body` gives; the changes, described."""
    changes = []
    if body.adapters is not None:
        records = [adapter_record(a) for a in body.adapters]
        if records != list(dep.adapters or []):
            changes.append(f"adapters -> {', '.join(r['name'] for r in records) or 'none'}")
            dep.adapters = records
    if body.max_adapters is not None and body.max_adapters != (dep.max_adapters or 0):
        changes.append(f"max_adapters {dep.max_adapters or 0} -> {body.max_adapters}")
        dep.max_adapters = body.max_adapters
    if dep.adapters and not dep.max_adapters:
        dep.max_adapters = DEFAULT_MAX_ADAPTERS
    return changes
