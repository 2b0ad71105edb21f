"""The small values many ranks load, read from the store once per job, not once per rank.

A checkpoint holds a replicated value once: FSDP2's per-parameter optimizer `step`, the
optimizer's hyperparameters, a pickled counter. DCP's de-duplication spreads these over the
ranks' files, so a rank that loads them all would read at least one checksum block (1 MiB and
more) of every other rank's file to get a few bytes of each: N blocks per rank at N ranks.

Here each such item (`ckpt.format.dcp_index.shared_refs`: short, held once, not a rank's own)
belongs to the rank that serves its file (`server`): the rank that wrote it, or on another
world size the rank that takes over the middle of its rows under FSDP's even split, which
reads that file anyway. A rank does not read the items of files it
does not serve; once every rank has read its own part (`exchange`), the ranks say which items
they wait for (one all-reduce of a bitmap), the serving ranks send those to rank 0 (a gather),
and rank 0 sends them all to every rank (a broadcast): a few collectives per restore, whatever
the world size, and a payload of the shared values alone.

Trust: a serving rank sends only bytes that matched the manifest's checksums as it read them.
The receiver cannot check them itself (a block checksum covers 1 MiB and more, not the few
bytes of one item): the ranks of a job trust each other here as they do with every gradient.
Received pickled values still load with `weights_only=True`. An item that no rank sent (its
server failed to read it, or holds no metadata) is read from the store by the rank that needs
it, which fails there as it would have without this.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ckpt.collectives import Group
from ckpt.format.dcp_index import Ref, shared_refs
from ckpt.format.manifest import Manifest
from ckpt.restore.tensor_stream import load_blob
from ckpt.restore.view import fetch, saved_by

log = logging.getLogger(__name__)

_BITS = 63  # bits of the need bitmap per int64 (the sign bit is left alone)


def server(rank: int, saved_on: int, world: int) -> int:
    """The rank of `world` that serves the file saving rank `rank` of `saved_on` wrote: the
    rank that loads the middle of its rows when every tensor is split evenly along its first
    dimension (FSDP), which reads that file anyway. The saving world size itself: the writer."""
    return min((2 * rank + 1) * world // (2 * max(saved_on, 1)), world - 1)


class Servers:
    """Data file -> the rank of this restore that serves it (`server`), for any file of the
    checkpoint, whichever part of the manifest this rank was told (`ckpt.restore.view`)."""

    def __init__(self, manifest: Manifest, world: int) -> None:
        self.manifest, self.world = manifest, world

    def get(self, name: str, default: int) -> int:
        saver = saved_by(self.manifest, name)
        return default if saver is None else server(saver, self.manifest.world_size, self.world)


@dataclass
class Sharing:
    """One rank's part in sharing the small items of one restore."""

    rank: int
    world: int
    refs: list[Ref]  # the shareable items, numbered alike on every rank
    servers: Servers  # data file -> the rank that reads its shared items
    pending: dict[int, list[ReadItem]] = field(default_factory=dict)  # items this rank waits for
    captured: dict[int, bytes] = field(default_factory=dict)  # shared items it read, verified
    received_bytes: int = 0

    @classmethod
    def of(cls, ctrl: Group, manifest: Manifest, metadata: Metadata) -> Sharing:
        """`metadata`: the whole `.metadata`, or the shared part of the index (`.index`)."""
        refs = shared_refs(metadata)
        return cls(ctrl.rank, ctrl.world, refs, Servers(manifest, ctrl.world))

    def __post_init__(self) -> None:
        self._number = {ref: i for i, ref in enumerate(self.refs)}

    def number(self, ref: Ref) -> int | None:
        """The item's number, if it is shared."""
        return self._number.get(ref)

    def serves(self, name: str) -> bool:
        """Whether this rank reads the shared items of data file `name`."""
        return self.servers.get(name, self.rank) == self.rank

    def defer(self, items: list[ReadItem], where: Callable[[ReadItem], Ref]) -> list[ReadItem]:
        """The items of `items` this rank reads itself; the others wait in `pending`."""
        keep = []
        for item in items:
            ref = where(item)
            i = self._number.get(ref)
            if i is None or self.serves(ref[0]):
                keep.append(item)
            else:
                self.pending.setdefault(i, []).append(item)
        return keep


def exchange(
    ctrl: Group, sharing: Sharing | None, planner: LoadPlanner, ok: bool, read: Callable[[list[Ref]], dict[Ref, bytes]], manifest: Manifest
) -> None:
    """Send and receive the shared items every rank waits for, then load them (a collective:
    every rank calls it once per restore, `ok` or not, so none is left alone in it). `read`
    reads items from the store, verified; it serves what this rank did not read already, and
    what no rank sent. Raises, after the collectives, if this rank could not load its items."""
    n = len(sharing.refs) if sharing is not None else 0
    waits = ok and sharing is not None and bool(sharing.pending)
    total, anyone = ctrl.max([n, int(waits)])
    if not anyone:
        return
    words = [0] * -(-total // _BITS)
    usable = sharing is not None and n == total  # every rank numbers the same .metadata alike
    if waits and usable:
        for i in sharing.pending:  # type: ignore[union-attr]
            words[i // _BITS] |= 1 << (i % _BITS)
    needed = ctrl.union(words)
    mine = _serve(sharing, needed, read) if usable else {}
    every = ctrl.gather(mine)
    sent = ctrl.broadcast({i: b for part in every for i, b in part.items()} if every is not None else None)
    unsent = [sharing.refs[i] for i in sharing.pending if i not in sent] if waits and sharing is not None else []
    # What no rank sent (its server could not read it), those waiting read themselves: the
    # entries of its files, which a rank's part of the manifest may lack (`ckpt.restore.view`).
    # Every rank knows whether any item is unsent (all know what was wanted and what was
    # sent), so all take this collective or none does.
    if any(i not in sent for i in _numbers(needed)):
        fetch(ctrl, manifest, {ref[0] for ref in unsent})
    if not waits:
        return
    assert sharing is not None
    sharing.received_bytes = sum(len(sent[i]) for i in sharing.pending if i in sent)
    got = read(unsent) if unsent else {}  # raises as a read of this rank's own would
    for i, reqs in sharing.pending.items():
        blob = sent[i] if i in sent else got[sharing.refs[i]]
        load_item(blob, reqs, planner)


def _serve(sharing: Sharing | None, needed: list[int], read: Callable[[list[Ref]], dict[Ref, bytes]]) -> dict[int, bytes]:
    """The items some rank waits for that this rank serves: those it read already, and the
    others read now. What it cannot read it leaves to the ranks that wait for it."""
    if sharing is None:
        return {}
    wanted = _numbers(needed)
    mine = [i for i in wanted if i < len(sharing.refs) and sharing.serves(sharing.refs[i][0])]
    out = {i: sharing.captured[i] for i in mine if i in sharing.captured}
    rest = [sharing.refs[i] for i in mine if i not in out]
    if rest:
        try:
            got = read(rest)
        except Exception as e:  # those waiting read it themselves, and say why it failed
            log.debug("rank %d could not read %d shared item(s) to send: %s", sharing.rank, len(rest), e)
            got = {}
        out.update((i, got[sharing.refs[i]]) for i in mine if sharing.refs[i] in got)
    return out


def _numbers(bitmap: list[int]) -> list[int]:
    """The items a bitmap of `Group.union` names."""
    return [w * _BITS + b for w, word in enumerate(bitmap) for b in range(_BITS) if word >> b & 1]


def load_item(blob: bytes, reqs: list[ReadItem], planner: LoadPlanner) -> None:
    """Load one item read by another rank (verified by whoever read it) into its targets."""
    if reqs[0].type == LoadItemType.BYTE_IO:
        for req in reqs:
            planner.load_bytes(req, io.BytesIO(blob))
    else:
        load_blob(blob, reqs, planner)
