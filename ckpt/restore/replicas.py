"""Replicated state read from the store once per group of replicas, not once per rank.

Under DDP every rank loads the whole model and optimizer; under HSDP the ranks that hold the
same shard in each of the R replicas load the same pieces; under tensor parallelism with data
parallelism, the ranks of one tensor-parallel position. DCP saves such a piece once, and
without this every rank that loads it reads it from the store: the whole state W times under
DDP, R times under HSDP.

Ranks whose plans ask for the same pieces (the same digest of their items that are neither
small shared values, `ckpt.restore.shared_items`, nor a rank's own, `rng.rank_N`) form a group
(`group`: one all-gather of 24 bytes per rank). The group's pieces are split among its members
by bytes, each member taking, as far as the balance allows, the pieces of the files it serves
(`shared_items.server`: on the world size that saved, its own file). Each member reads its
part from the store, verified against the manifest as always, and once every rank has read,
sends it to the others of its group, point to point over the job's gloo group (`exchange`):
each member reads 1/g of the group's bytes from the store and sends and receives (g-1)/g of
them, as a ring all-gather would. One all-reduce of a bitmap says which ranks could not read
their part: their pieces are read from the store by each rank that needs them, as without
this, and fail there as they would have.

Trust: as with the small shared values, a rank sends only bytes that matched the manifest's
checksums as it read them, and received tensors load with `torch.load(weights_only=True)`.
Memory: a member keeps the bytes of its part until it sent them (1/g of the group's pieces);
a receiver holds at most `_WINDOW` bytes received and not yet loaded.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ckpt.collectives import Group
from ckpt.format.dcp_index import Ref
from ckpt.restore.shared_items import Servers, load_item

log = logging.getLogger(__name__)

_DIGEST = 24  # bytes each rank sends to find its group: 16 of digest, 8 of the pieces' bytes
_NONE = bytes(_DIGEST)  # a rank with nothing replicated to load (or that did not plan)
_MESSAGE = 32 << 20  # pieces sent together, up to this many bytes (a longer piece goes alone)
_WINDOW = 256 << 20  # bytes a rank receives ahead of loading them
_BITS = 63


@dataclass
class Replicas:
    """One rank's part in reading the replicated pieces of a restore once per group."""

    rank: int
    members: list[int]  # this rank's group, sorted, itself included; [rank] alone: no group
    owner: dict[Ref, int]  # each piece of the group -> the member that reads it from the store
    pending: dict[Ref, list[ReadItem]] = field(
        default_factory=dict
    )  # pieces others read, and this rank's items of each
    captured: dict[Ref, bytes] = field(default_factory=dict)  # its own part, read and verified
    received_bytes: int = 0

    def reads(self, ref: Ref) -> bool:
        """Whether this rank reads piece `ref` for its group (and keeps its bytes to send)."""
        return self.owner.get(ref) == self.rank

    def part(self, member: int) -> list[Ref]:
        """The pieces `member` reads, in file order: alike on every member of the group."""
        return sorted(ref for ref, who in self.owner.items() if who == member)

    def complete(self) -> bool:
        """Whether this rank read its whole part and can send it."""
        return all(ref in self.captured for ref in self.part(self.rank))


def group(
    ctrl: Group, pieces: dict[Ref, list[ReadItem]], servers: Servers
) -> Replicas | None:
    """Find this rank's group of replicas and split the group's pieces among its members: a
    collective, called once per restore on every rank (with no pieces by a rank that did not
    get as far as reading). `pieces`: the pieces this rank could receive instead of reading
    them, with its items of each; `servers`: data file -> the rank that serves it. None on
    every rank when no two ranks of the job load the same pieces."""
    digest = _digest(pieces) if pieces else _NONE
    every = ctrl.all_gather_fixed(digest)
    counts = Counter(every)  # IMPORTANT: once, not a count per rank: O(W), not O(W^2) at 10k ranks
    if not any(d != _NONE and n > 1 for d, n in counts.items()):
        return None
    members = [r for r, d in enumerate(every) if d == digest] if digest != _NONE else [ctrl.rank]
    if len(members) < 2:
        return Replicas(ctrl.rank, [ctrl.rank], {})
    owner = _assign(sorted(pieces), members, servers)
    pending = {ref: items for ref, items in pieces.items() if owner[ref] != ctrl.rank}
    return Replicas(ctrl.rank, members, owner, pending)


def _digest(pieces: dict[Ref, list[ReadItem]]) -> bytes:
    """What this rank loads of `pieces`, in 24 bytes: equal only on ranks that load the same."""
    h = hashlib.blake2b(digest_size=16)
    for ref in sorted(pieces):
        items = sorted(
            (
                i.type.value,
                i.dest_index.fqn,
                tuple(i.dest_offsets),
                tuple(i.storage_offsets),
                tuple(i.lengths),
            )
            for i in pieces[ref]
        )
        h.update(repr((ref, items)).encode())
    return h.digest() + sum(ref[2] for ref in pieces).to_bytes(8, "little")


def _assign(refs: list[Ref], members: list[int], servers: Servers) -> dict[Ref, int]:
    """Each piece to one member: the one that serves its file while that member's bytes stay
    within a quarter over an even share, else the member with the fewest bytes so far."""
    load = dict.fromkeys(members, 0)
    cap = sum(n for _, _, n in refs) * 1.25 / len(members)
    owner = {}
    for ref in refs:
        who = servers.get(ref[0], -1)
        if who not in load or load[who] + ref[2] > cap:
            who = min(members, key=lambda m: (load[m], m))
        owner[ref] = who
        load[who] += ref[2]
    return owner


def exchange(
    ctrl: Group,
    replicas: Replicas | None,
    planner: LoadPlanner,
    ok: bool,
    read: Callable[[list[Ref]], dict[Ref, bytes]],
) -> None:
    """Send this rank's part to the other members of its group, receive theirs and load them
    (a collective: every rank calls it once per restore, `ok` or not, after `group`). `read`
    reads pieces from the store, verified: those of members that could not send. Raises,
    after every transfer, if this rank could not load its pieces."""
    if replicas is None:
        return
    words = [0] * -(-ctrl.world // _BITS)
    if len(replicas.members) > 1 and not replicas.complete():
        words[ctrl.rank // _BITS] |= 1 << (ctrl.rank % _BITS)
    failed = ctrl.union(words)
    if len(replicas.members) < 2:
        return
    sends = _send(ctrl, replicas, failed)
    try:
        unsent = _receive(ctrl, replicas, planner, ok, failed)
    finally:
        for work in sends:
            work.wait()
        replicas.captured.clear()
    if ok and unsent:
        got = read(unsent)  # raises as a read of this rank's own would
        for ref in unsent:
            load_item(got[ref], replicas.pending[ref], planner)


def _messages(refs: list[Ref]) -> list[list[Ref]]:
    """`refs` in messages of up to `_MESSAGE` bytes, in order."""
    out: list[list[Ref]] = []
    size = _MESSAGE
    for ref in refs:
        if size + ref[2] > _MESSAGE:
            out.append([])
            size = 0
        out[-1].append(ref)
        size += ref[2]
    return out


def _is_set(words: list[int], rank: int) -> bool:
    return bool(words[rank // _BITS] >> (rank % _BITS) & 1)


def _send(ctrl: Group, replicas: Replicas, failed: list[int]) -> list[dist.Work]:
    """Start sending this rank's part to the other members, unless it could not read it all."""
    if _is_set(failed, ctrl.rank):
        return []
    works = []
    for tag, refs in enumerate(_messages(replicas.part(ctrl.rank))):
        # One copy per message, and each piece let go of as its message is made: the part
        # is held once (in the messages until they are sent), not twice or three times.
        data = torch.frombuffer(bytearray().join([replicas.captured.pop(r) for r in refs]), dtype=torch.uint8)
        for member in replicas.members:
            if member != ctrl.rank:
                works.append(dist.isend(data, dst=member, group=ctrl.pg, tag=tag))
    return works


def _receive(
    ctrl: Group, replicas: Replicas, planner: LoadPlanner, ok: bool, failed: list[int]
) -> list[Ref]:
    """Receive every other member's part, at most `_WINDOW` bytes ahead of loading it, and load
    it (if `ok`); returns the pieces of the members that could not send."""
    unsent: list[Ref] = []
    incoming: list[tuple[int, int, list[Ref]]] = []  # (member, tag, pieces), in the order loaded
    for member in replicas.members:
        if member == ctrl.rank:
            continue
        part = replicas.part(member)
        if _is_set(failed, member):
            unsent += part
        else:
            incoming += [(member, tag, refs) for tag, refs in enumerate(_messages(part))]
    posted: list[tuple[dist.Work, torch.Tensor, list[Ref]]] = []
    ahead = 0
    nxt = 0
    error: Exception | None = (
        None  # raised once every message was received: each sender waits for its own
    )
    while nxt < len(incoming) or posted:
        while nxt < len(incoming) and (
            not posted or ahead + sum(r[2] for r in incoming[nxt][2]) <= _WINDOW
        ):
            member, tag, refs = incoming[nxt]
            buf = torch.empty(sum(r[2] for r in refs), dtype=torch.uint8)
            posted.append((dist.irecv(buf, src=member, group=ctrl.pg, tag=tag), buf, refs))
            ahead += buf.numel()
            nxt += 1
        work, buf, refs = posted.pop(0)
        work.wait()
        ahead -= buf.numel()
        replicas.received_bytes += buf.numel()
        if ok and error is None:
            view = memoryview(buf.numpy())
            at = 0
            try:
                for ref in refs:
                    load_item(bytes(view[at : at + ref[2]]), replicas.pending[ref], planner)
                    at += ref[2]
            except Exception as e:
                error = e
    if error is not None:
        raise error
    return unsent
