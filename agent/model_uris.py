"""Model URIs for the control plane, which never imports `engine` directly (the layering
rule): checking a URI at deploy time and pinning an `hf://` revision to its commit. The
implementation is `engine.models` (torch-free); this is its one door upward."""

from __future__ import annotations

from engine.models import BadModelUri, ModelStoreError, check_model_uri, is_remote, source_for, uri_scheme
from engine.models.hf import HfSource


def pin_model_uri(uri: str) -> str:
    """`uri` canonical; an hf:// one with its revision resolved to a commit (asks the hub
    unless it names one). Raises ModelStoreError (BadModelUri for a malformed one)."""
    canonical = check_model_uri(uri)
    if uri_scheme(canonical) != "hf":
        return canonical
    source = source_for(canonical)
    assert isinstance(source, HfSource)
    return source.pinned()


__all__ = ["BadModelUri", "ModelStoreError", "check_model_uri", "is_remote", "pin_model_uri"]
