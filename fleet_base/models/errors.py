"""What can go wrong fetching a model, each with a short `reason` code.

The code travels in agent events and API errors (`unknown_scheme`, `missing_object`,
`checksum_mismatch`, `no_credentials`, `disk_full`, ...), so an operator sees why a
replica did not start without reading a traceback.
"""

from __future__ import annotations


class ModelStoreError(Exception):
    """A model could not be named, found, fetched or cached; `reason` is a stable code."""

    reason = "model_error"
    # Whether trying again later may help (a network blip) or not (a bad URI).
    retryable = True

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class BadModelUri(ModelStoreError, ValueError):
    """The text is not a model URI this build understands."""

    reason = "bad_uri"
    retryable = False


class UnknownScheme(BadModelUri):
    reason = "unknown_scheme"


class MissingObject(ModelStoreError):
    """The store answered, but the bucket, key, repo, file, tag or URL is not there."""

    reason = "missing_object"


class NoCredentials(ModelStoreError):
    """The store wants credentials this process does not have, or refused them."""

    reason = "no_credentials"


class ChecksumMismatch(ModelStoreError):
    """Downloaded bytes do not match the store's checksum; the file was discarded."""

    reason = "checksum_mismatch"


class DiskFull(ModelStoreError):
    """Not enough room in the cache (its size bound, or the disk itself)."""

    reason = "disk_full"


class StoreUnreachable(ModelStoreError):
    """The store could not be reached (connection refused, timeout, DNS)."""

    reason = "unreachable"
