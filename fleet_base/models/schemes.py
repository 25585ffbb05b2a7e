"""The one table of model URI schemes: scheme -> the `Source` that speaks it.

Anything without `scheme://` is a local name (an alias or a path, `engine.model_files.aliases`).
"""

from __future__ import annotations

import re

from fleet_base.models.errors import UnknownScheme
from fleet_base.models.hf import HfSource
from fleet_base.models.https import HttpsSource
from fleet_base.models.oci import OciSource
from fleet_base.models.s3 import S3Source
from fleet_base.models.source import Source

SCHEMES: dict[str, type[Source]] = {
    "s3": S3Source,
    "hf": HfSource,
    "oci": OciSource,
    "https": HttpsSource,
    "http": HttpsSource,
}
_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")


def uri_scheme(model: str) -> str | None:
    """'s3' for 's3://b/k'; None for an alias or a path."""
    m = _SCHEME.match(model.strip())
    return m["scheme"].lower() if m else None


def is_remote(model: str) -> bool:
    return uri_scheme(model) is not None


def source_for(uri: str) -> Source:
    """The store client for `uri`; UnknownScheme or BadModelUri when it cannot be one."""
    uri = uri.strip()
    scheme = uri_scheme(uri)
    cls = SCHEMES.get(scheme or "")
    if cls is None:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise UnknownScheme(
            f"{uri!r}: unknown scheme {scheme!r} (known: {known}, or an alias or a local path)"
        )
    return cls(uri)


def check_model_uri(model: str) -> str:
    """`model` unchanged if it is local, else its canonical URI; raises on a bad one (no network)."""
    return source_for(model).canonical if is_remote(model) else model


def pin_model_uri(uri: str) -> str:
    """`uri` canonical; an hf:// one with its revision resolved to a commit (asks the hub
    unless it names one), so a deployment keeps serving the weights it was checked with.
    Raises ModelStoreError (BadModelUri for a malformed one)."""
    canonical = check_model_uri(uri)
    if uri_scheme(canonical) != "hf":
        return canonical
    source = source_for(canonical)
    assert isinstance(source, HfSource)
    return source.pinned()
