"""The node spool's own retention: the newest committed checkpoints of each job stay for
fast restarts on the node (`keep_spool`), within the spool's budget and its disk, with room
kept for the next save; what failed or was never handed off goes. Only directories named
as a job's and a step's are removed, through no link, and never one a rank still writes.
"""

from __future__ import annotations

import logging
import os
import time

from ckpt.agent.config import Config
from ckpt.agent.intake import Requests
from ckpt.agent.serving import AgentMetrics
from ckpt.node.spool import COMMITTED, FAILED, Spool
from ckpt.storage.nofollow import UnsafeEntry, remove_tree

log = logging.getLogger(__name__)

ORPHAN_AFTER_S = 600.0  # a step directory without a request, untouched this long: a crashed write


class SpoolRetention:
    """Prunes one spool (`prune`); `usage` is what the last pass found."""

    def __init__(self, config: Config, spool: Spool, metrics: AgentMetrics, requests: Requests) -> None:
        self.config, self.spool, self.metrics, self.requests = config, spool, metrics, requests
        self.budget = config.spool_budget or _disk_size(spool.path)
        metrics.budget.set(self.budget)
        self.usage = {"used": 0, "evictable": 0, "free": 0}
        self._largest = 0  # bytes of the largest step directory seen: room kept free for the next save

    def prune(self) -> None:
        """Keep the newest `keep_spool` committed checkpoints of each job, drop finished
        hand-offs that did not commit and orphaned step directories, and stay within the
        budget, with room for the next save (oldest committed first). Never a directory
        with a hand-off still pending, nor one not named as a job's and a step's."""
        kept: list[tuple[float, str, int]] = []
        used = 0
        for job, rels in self.spool.steps().items():
            done = []
            for rel in rels:
                d = f"jobs/{job}/{rel}"  # in the spool
                size, newest = self.spool.usage(d)
                used += size
                self._largest = max(self._largest, size)
                states = [self.requests.state(p) for p in self.spool.request_files(job, rel)]
                # IMPORTANT: never while a rank writes a save's files here (its request comes once
                # they are durable, which may take as long as the slowest rank's write): a later
                # save of a step whose hand-off failed (a restarted job's) among them. A marker
                # older than commit_wait is a crashed writer's.
                writing = self.spool.writing(d, self.config.commit_wait)
                if not states:
                    if not writing and time.time() - newest > ORPHAN_AFTER_S:
                        self._remove(d, "no hand-off (a write that never finished)")
                        used -= size
                elif all(s == FAILED for s in states):
                    if not writing:
                        self._remove(d, "its hand-off failed")
                        used -= size
                elif all(s in (COMMITTED, FAILED) for s in states):
                    done.append((newest, d, size))
            done.sort()
            surplus = max(len(done) - self.config.keep_spool, 0)
            for _, d, size in done[:surplus]:
                self._remove(d, f"more than {self.config.keep_spool} committed checkpoints of the job")
                used -= size
            kept += done[surplus:]
        free = _disk_free(self.spool.path)
        for _, d, size in sorted(kept):
            if used <= self.budget - self._largest and free >= self._largest:
                break
            self._remove(d, "room for the next save (the spool's budget or its disk)")
            used, free = used - size, free + size
            kept = [k for k in kept if k[1] != d]
        self.usage = {"used": used, "evictable": sum(k[2] for k in kept), "free": free}
        self.metrics.spool_bytes.set(used)

    def _remove(self, d: str, why: str) -> None:
        """Remove the spool's step directory `d` (relative to the spool), through no link."""
        log.info("spool: removing %s: %s", d, why)
        try:
            remove_tree(self.spool.path, d)
        except (OSError, UnsafeEntry) as e:
            log.warning("spool: cannot remove %s: %s", d, e)


def _disk_size(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def _disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
