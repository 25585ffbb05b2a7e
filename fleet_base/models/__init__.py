"""Model files from anywhere a model is named: `s3://`, `hf://`, `oci://`, `https://`
(one module per scheme, one table in `schemes`), into the node's verified cache.

Torch-free: the engine, the agent (pre-pull), the gateway (tokenizers) and the control
plane (checking a URI at deploy time) all import it.
"""

from __future__ import annotations

from fleet_base.models.cache import CacheEntry, ModelCache, PullResult, default_cache_dir
from fleet_base.models.errors import (
    BadModelUri,
    ChecksumMismatch,
    DiskFull,
    MissingObject,
    ModelStoreError,
    NoCredentials,
    StoreUnreachable,
    UnknownScheme,
)
from fleet_base.models.schemes import (
    SCHEMES,
    check_model_uri,
    is_remote,
    pin_model_uri,
    source_for,
    uri_scheme,
)

__all__ = [
    "SCHEMES",
    "BadModelUri",
    "CacheEntry",
    "ChecksumMismatch",
    "DiskFull",
    "MissingObject",
    "ModelCache",
    "ModelStoreError",
    "NoCredentials",
    "PullResult",
    "StoreUnreachable",
    "UnknownScheme",
    "check_model_uri",
    "default_cache_dir",
    "is_remote",
    "pin_model_uri",
    "source_for",
    "uri_scheme",
]
