"""The save in flight (ckpt.save.slot), one per rank: a save that comes due while it still writes
waits for it (if_busy="wait") or is skipped and counted ("skip"); over the host memory budget
a save stages nothing and streams from the live state."""

from __future__ import annotations

import logging
import re

import torch

import ckpt


def _train_with_slow_store(tmp_path, monkeypatch, if_busy: str):
    import time

    import torch

    monkeypatch.setenv("CKPT_FAULT", "before_manifest:*:*:sleep=0.3")  # every save commits slowly
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=ckpt.Every(steps=1), if_busy=if_busy, keep=ckpt.Keep(last=100)) as cp:
        started = time.perf_counter()
        for _ in range(10):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        loop_s = time.perf_counter() - started
    return cp, loop_s, sorted(int(p.name[5:]) for p in tmp_path.glob("step-*/manifest.json") for p in [p.parent])


def test_if_busy_skip_never_waits_for_a_slow_store_and_counts_what_it_skipped(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    cp, loop_s, committed = _train_with_slow_store(tmp_path, monkeypatch, "skip")
    skipped = [int(m) for m in re.findall(r"step (\d+): a save is due but the last one is still writing; skipped", caplog.text)]
    assert cp.skipped_saves >= 5 and len(skipped) == cp.skipped_saves
    # Every step saved but the skipped ones, and the last on leaving; nothing else written.
    assert committed == sorted((set(range(1, 11)) - set(skipped)) | {10})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{s:010d}" for s in committed]
    # Ten saves that each take 0.3 s to commit: waiting for them would take 3 s.
    assert loop_s < 1.5, loop_s


def test_if_busy_wait_saves_every_due_step(tmp_path, monkeypatch):
    cp, loop_s, committed = _train_with_slow_store(tmp_path, monkeypatch, "wait")
    assert cp.skipped_saves == 0 and committed == list(range(1, 11))


def test_over_the_host_memory_budget_a_save_streams_from_the_live_state_and_says_so(tmp_path, caplog):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    caplog.set_level(logging.WARNING, logger="ckpt")
    with ckpt.Checkpointer(tmp_path, model=model, optimizer=opt, interval=ckpt.Every(steps=2), host_memory_budget=1000) as cp:
        for _ in range(4):
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert caplog.text.count("would exceed the host memory budget") == 1  # said once
    assert cp._slot.stager.bytes_staged == 0  # no host copy was made

    model2 = torch.nn.Linear(64, 64)
    with ckpt.Checkpointer(tmp_path, model=model2, optimizer=torch.optim.AdamW(model2.parameters()), save_on_exit=False) as cp2:
        assert cp2.step == 4
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k])
