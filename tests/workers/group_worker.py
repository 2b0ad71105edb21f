"""Runs on each rank of a gloo job (tests/test_collectives.py): ckpt's collectives over its own
groups (`ckpt.collectives.Group`), counted as torch's collective calls, then a save whose files'
entries do not fit `gather_short` at first. Writes what it saw to <out>/rank<N>.json."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ckpt
from ckpt.collectives import _SHORT, Group, TooLong
from tests.support.launch import exit_without_teardown

calls: list[str] = []


def counted(name: str) -> None:
    real = getattr(dist, name)

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(name)
        return real(*args, **kwargs)

    setattr(dist, name, call)


def ops(fn):  # noqa: ANN001, ANN201
    """`fn()` and the torch collectives it called (gather_object is one call of two collectives)."""
    calls.clear()
    got = fn()
    return got, list(calls)


def sized(n: int) -> bytes:
    """A bytes object whose pickle is exactly `n` bytes long."""
    for k in range(n, 0, -1):
        if len(pickle.dumps(b"x" * k)) == n:
            return b"x" * k
    raise AssertionError(n)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in ("broadcast", "gather", "broadcast_object_list", "gather_object", "all_gather"):
        counted(name)
    g = Group.new(60)
    seen: dict = {}
    # broadcast: one collective up to _SHORT bytes of pickle (8 of them the length), two past it
    for label, obj in [
        ("small", {"plan": [3, 2, 1], "why": None}),
        ("fits", sized(_SHORT - 8)),
        ("just over", sized(_SHORT - 7)),
        ("large", os.urandom(100_000) if rank == 0 else b""),
    ]:
        got, n = ops(lambda obj=obj: g.broadcast(obj if rank == 0 else None))
        seen[f"broadcast {label}"] = [pickle.dumps(got).hex() if label == "large" else repr(got)[:80], n]
    big = g.broadcast(os.urandom(100_000) if rank == 0 else None)
    seen["large equal"] = g.gather(big)  # rank 0: every rank's copy
    if rank == 0:
        seen["large equal"] = all(x == big for x in seen["large equal"])
    # gather_short: one collective; a rank whose object is too long is a TooLong on rank 0
    small = {"rank": rank, "files": ["a"] * rank}
    got, n = ops(lambda: g.gather_short(small))
    seen["gather_short small"] = [got, n]
    long = sized(g.gather_bytes - 7) if rank == world - 1 else small  # one byte over
    got, n = ops(lambda: g.gather_short(long))
    seen["gather_short long"] = [[x.n if isinstance(x, TooLong) else x for x in got] if got else got, n]
    g.fit(g.gather_bytes - 7)  # as persist does: with the length rank 0 tells every rank
    got, n = ops(lambda: g.gather_short(long))
    seen["gather_short after fit"] = [[len(pickle.dumps(x)) for x in got] if got else got, n, g.gather_bytes]
    g.fit(2 << 20)  # past the most a gather_short sends: plain gather from then on
    got, n = ops(lambda: g.gather_short(small))
    seen["gather_short past max"] = [got, n, g.gather_bytes]

    # Saves whose files' entries do not fit the writers' gather_short: they commit all the same
    # (rank 0 asks every rank again); the first save (DCP's) tells less than the resaves after
    # it (where each object was placed), so the room grows twice, then fits.
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    for name in ("gather", "gather_short"):  # ckpt's own, as persist calls them
        real = getattr(Group, name)
        setattr(Group, name, lambda self, obj, real=real, name=name: calls.append(f"Group.{name}") or real(self, obj))
    with ckpt.Checkpointer(str(out / "root"), model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
        assert cp._io is None, "the writers' group is made at the first save, not on entering"
        made = Group.new  # the writers' group, made by the first save below, starts with 64 bytes
        Group.new = classmethod(lambda cls, timeout_s: dataclasses.replace(made(timeout_s), gather_bytes=64))  # type: ignore[method-assign]
        for _ in range(4):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
            calls.clear()
            cp.save(blocking=True)
            seen.setdefault("saves", []).append([cp.last_commit.step, cp._io.gather_bytes, calls.count("Group.gather_short"), calls.count("Group.gather")])
    (out / f"rank{rank}.json").write_text(json.dumps(seen, default=repr))
    dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    main()
