"""What asks a rank to stop: a notice file (and SIGTERM, in test_distributed)."""

from __future__ import annotations

import os

from ckpt import preempt
from ckpt.preempt import Preemption


def test_a_notice_counts_when_it_appears_or_is_touched_again_not_when_it_was_there_before(tmp_path, monkeypatch):
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 0.0)
    notice = tmp_path / "notice"
    p = Preemption(str(notice))
    p.start(sigterm=False)
    assert not p.asked()
    notice.touch()
    assert p.asked() and p.why == f"notice file {notice}"

    stale = Preemption(str(notice))  # the next run finds it there
    stale.start(sigterm=False)
    assert not stale.asked()
    st = notice.stat()
    os.utime(notice, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched again
    assert stale.asked()


def test_the_notice_path_comes_from_the_environment_and_is_looked_at_now_and_then(tmp_path, monkeypatch):
    notice = tmp_path / "notice"
    monkeypatch.setenv("CKPT_PREEMPT_FILE", str(notice))
    p = Preemption()
    assert p.notice_files == [str(notice)]
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 3600.0)  # a loaded machine may stall for a while
    p.start(sigterm=False)
    assert not p.asked()  # looked: nothing
    notice.touch()
    assert not p.asked()  # not looked again within CHECK_EVERY_S
    monkeypatch.setattr(preempt, "CHECK_EVERY_S", 0.0)
    p._next_check = 0.0
    assert p.asked()
    monkeypatch.delenv("CKPT_PREEMPT_FILE")
    assert Preemption().notice_files == []
