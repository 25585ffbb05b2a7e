"""Fencing at the agent: the highest control-plane epoch seen per KV bucket, below which
nothing is obeyed.

Every value the control plane writes to `fleet_desired`, `fleet_routes` and `fleet_keys`
carries the epoch of the leader that wrote it (`fleet_base.protocol.Epoch`). A paused old
leader that wakes up still holds its old epoch, so its writes are refused here even if one
reaches the bucket (control_plane.loops.publish keeps that window short): a value of a
lower epoch than the bucket's highest, epoch 0 after a higher one included, is not applied,
is logged once at warning and counted (`fleet_agent_fenced_writes_total{bucket}` on the
gateway's /metrics, from fence.json). A higher epoch is a new leader: it is taken at once.

Deletions carry no epoch and are obeyed: the control plane deletes by compare-and-set on
the revision it last saw, so an old leader's delete of a key its successor has written
fails; one that lands before the successor's first publish reached that key is undone by
that publish (it writes the key again, and agents take it: the epoch is higher). Refusing
deletions instead would keep a revoked key or a removed route alive on every agent.

The fence is kept in fence.json, beside the state it guards, so a restart does not reopen
it; an agent upgraded from before fencing starts from the epochs of the entries on disk.
"""

from __future__ import annotations

import logging

from fleet_base.local_state import BucketFence, FenceState, LocalState

log = logging.getLogger("agent")


class EpochFence:
    def __init__(self, files: LocalState | None = None) -> None:
        self.files = files
        self.state = files.load_fence() if files is not None else FenceState()
        self._warned: set[tuple[str, int]] = set()

    def epoch(self, bucket: str) -> int:
        return self._bucket(bucket).epoch

    def highest(self) -> int:
        """The highest epoch accepted in any bucket (heartbeats report it: a leader below it
        learns its database lost history, or that it was deposed)."""
        return max((fence.epoch for fence in self.state.buckets.values()), default=0)

    def refused(self, bucket: str) -> int:
        return self._bucket(bucket).refused

    def observe(self, bucket: str, epoch: int) -> None:
        """An epoch known to have been obeyed already (entries loaded from disk)."""
        if epoch > self.epoch(bucket):
            self._bucket(bucket).epoch = epoch
            self._save()

    def admits(self, bucket: str, key: str, epoch: int) -> bool:
        """Whether a value of `epoch` under `key` may be applied; raises the fence on a
        higher epoch, counts and logs a lower one."""
        fence = self._bucket(bucket)
        if epoch >= fence.epoch:
            if epoch > fence.epoch:
                log.info("%s: control-plane epoch %d (was %d)", bucket, epoch, fence.epoch)
                fence.epoch = epoch
                self._save()
            return True
        fence.refused += 1
        if (bucket, epoch) not in self._warned:
            self._warned.add((bucket, epoch))
            log.warning(
                "refusing %s/%s of control-plane epoch %d: epoch %d wrote this bucket since "
                "(a deposed leader's write; further ones of that epoch are counted, not logged)",
                bucket,
                key,
                epoch,
                fence.epoch,
            )
        self._save()
        return False

    def _bucket(self, bucket: str) -> BucketFence:
        return self.state.buckets.setdefault(bucket, BucketFence())

    def _save(self) -> None:
        if self.files is None:
            return
        try:
            self.files.save_fence(self.state)
        except OSError as err:  # counted in LocalState.writes; memory still fences
            log.warning("could not write %s: %s", self.files.fence_path, err)
