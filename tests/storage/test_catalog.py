"""Listing a root and what the catalog makes of it: `Store.scan` lists a local root as any other
store lists it, and leaves out what goes while it lists; `catalog.Scans` reads again only the
manifests that changed, so retention reads each kept manifest once, and after the job's own
commits lists the root only now and then."""

from __future__ import annotations

import pytest

import ckpt
from ckpt.storage import catalog
from ckpt.storage.store import Store, step_dir_name
from tests.support.loop import run, step_dirs


def _manifest_reads(monkeypatch) -> list[str]:
    """The step directories whose manifest is read through a Store from now on."""
    reads: list[str] = []
    real = Store.read_bytes

    def counting(self, rel):
        if rel.endswith("/manifest.json"):
            reads.append(rel.split("/")[0])
        return real(self, rel)

    monkeypatch.setattr(Store, "read_bytes", counting)
    return reads


def _root_listings(monkeypatch) -> list[int]:
    """One item per listing of a whole root through a Store from now on."""
    listed: list[int] = []
    real = Store.survey

    def counting(self, whole=True):
        listed.append(1)
        return real(self, whole)

    monkeypatch.setattr(Store, "survey", counting)
    return listed


@pytest.mark.parametrize("keep", [ckpt.Keep(last=100), ckpt.Keep(last=2)], ids=["all kept", "last 2"])
def test_retention_after_the_jobs_own_commits_lists_the_root_once_and_reads_no_manifest_again(tmp_path, monkeypatch, keep):
    """The root changes by the job's own commits alone (its lease keeps other jobs out): the
    first save's retention lists it, the next ones go by that listing and their own commits,
    and delete what `keep` lets go of all the same. At 10,000 ranks a listing is tens of
    LIST pages for each checkpoint kept."""
    reads, listed = _manifest_reads(monkeypatch), _root_listings(monkeypatch)
    run(tmp_path / "root", 40, keep)  # 8 saves
    kept = range(5, 41, 5) if keep.last == 100 else (35, 40)
    assert step_dirs(tmp_path / "root") == [step_dir_name(s) for s in kept]
    # the restore at the start lists the root once (nothing there); the first save's retention once
    assert len(listed) == 2 and reads == [step_dir_name(5)], (listed, reads)


def test_retention_lists_the_root_again_when_its_last_listing_is_old(tmp_path, monkeypatch):
    """A step directory made by hand (or a failed save's debris) is seen within FULL_SCAN_S."""
    monkeypatch.setattr(catalog, "FULL_SCAN_S", 0.0)
    listed = _root_listings(monkeypatch)
    run(tmp_path / "root", 20, ckpt.Keep(last=2))  # 4 saves
    assert len(listed) == 1 + 4
    assert step_dirs(tmp_path / "root") == [step_dir_name(15), step_dir_name(20)]


def test_scans_read_again_only_what_changed_and_see_a_manifest_rewritten_or_a_step_gone(tmp_path, monkeypatch):
    root = tmp_path / "root"
    run(root, 20, ckpt.Keep(last=100))  # steps 5, 10, 15, 20
    store = Store(str(root))
    reads = _manifest_reads(monkeypatch)
    scans = catalog.Scans()

    def states() -> dict[int, str]:
        got = {e.step: e.state for e in scans.scan(store)}
        assert got == {e.step: e.state for e in catalog.scan(store)}  # always what a full scan says
        return got

    assert states() == {5: "committed", 10: "committed", 15: "committed", 20: "committed"}
    reads.clear()
    assert states() == {5: "committed", 10: "committed", 15: "committed", 20: "committed"}
    assert reads == [step_dir_name(s) for s in (5, 10, 15, 20)]  # the full scans' reads alone

    # A manifest rewritten with the same size (a step number changed) and one cut short.
    m10, m15 = root / step_dir_name(10) / "manifest.json", root / step_dir_name(15) / "manifest.json"
    m10.write_text(m10.read_text().replace('"step": 10', '"step": 11'))
    m15.write_bytes(m15.read_bytes()[:-7])
    (root / step_dir_name(30)).mkdir()  # a save being written
    (root / step_dir_name(30) / "__0_0.distcp").write_bytes(b"half")
    import shutil

    shutil.rmtree(root / step_dir_name(5))
    reads.clear()
    assert states() == {10: "corrupt", 15: "corrupt", 20: "committed", 30: "incomplete"}
    assert sorted(reads[:2]) == [step_dir_name(10), step_dir_name(15)]  # the Scans' reads come first
    # What is not committed is read at every scan; only the committed one is kept.
    reads.clear()
    assert states() == {10: "corrupt", 15: "corrupt", 20: "committed", 30: "incomplete"}
    assert sorted(reads[:2]) == [step_dir_name(10), step_dir_name(15)]


def test_a_local_root_is_listed_as_any_other_store_lists_it(tmp_path):
    """The local scan walks the step directories with os.scandir, not fsspec's walk: it must
    list what the generic walk lists of the same tree (here a copy in fsspec's memory store)."""
    import fsspec

    root = tmp_path / "root"
    run(root, 10, ckpt.Keep(last=100))  # committed steps 5 and 10
    (root / step_dir_name(30) / "nested" / "deeper").mkdir(parents=True)  # a save being written
    (root / step_dir_name(30) / "nested" / "deeper" / "part").write_bytes(b"12345")
    (root / step_dir_name(30) / "__0_0.distcp").write_bytes(b"half")
    (root / step_dir_name(40)).mkdir()  # an empty one
    (root / "lease.json").write_text("{}")  # not a step: neither listed nor walked
    (root / "not-a-step").mkdir()
    (root / "not-a-step" / "x").write_bytes(b"x")

    mem = fsspec.filesystem("memory")
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            mem.makedirs(f"/copy/{rel}", exist_ok=True)
        else:
            mem.pipe_file(f"/copy/{rel}", path.read_bytes())
    local, generic = Store(str(root)).scan(), Store("memory://copy").scan()
    assert sorted(local) == sorted(generic) == [5, 10, 30, 40]
    for step, listing in local.items():
        assert listing.files == generic[step].files, step
    assert local[30].files == {"__0_0.distcp": 4, "nested/deeper/part": 5}
    assert local[40].files == {}
    for step in (5, 10):  # the manifest's write time, which the Scans compare
        assert local[step].manifest_mtime == (root / step_dir_name(step) / "manifest.json").stat().st_mtime
    assert local[30].manifest_mtime is None


def test_a_local_root_that_is_not_there_lists_empty_and_an_unreadable_one_is_an_error(tmp_path):
    assert Store(str(tmp_path / "nowhere")).scan() == {}
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="listing"):  # NotADirectoryError: never "empty"
        Store(str(tmp_path / "afile")).scan()


def test_a_step_directory_deleted_while_the_root_is_listed_is_left_out(tmp_path, monkeypatch):
    import shutil

    from ckpt.storage import store as storage
    for step in (1, 2):
        (tmp_path / step_dir_name(step) / "sub").mkdir(parents=True)
        (tmp_path / step_dir_name(step) / "f").write_bytes(b"ab")
    real = storage.os.scandir

    def deleting(path):  # another process's retention deletes step 2 as it is reached
        if str(path).endswith(step_dir_name(2)) or str(path).endswith(f"{step_dir_name(1)}/sub"):
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(storage.os, "scandir", deleting)
    listed = Store(str(tmp_path)).scan()
    assert sorted(listed) == [1] and listed[1].files == {"f": 2}  # step 1 lost only its empty subdirectory


def test_commits_learned_from_the_node_agent_count_for_retention_without_a_listing(tmp_path, monkeypatch):
    """A save handed off to the node agent commits later; the trainer learns of it
    (`Scans.learned`) and retention then counts it, and deletes what `keep` lets go of, by
    the last listing: a save handed off and not committed yet is not counted."""
    root = tmp_path / "root"
    run(root, 30, ckpt.Keep(last=100))  # steps 5 .. 30
    store = Store(str(root))
    scans = catalog.Scans()
    manifests = {e.step: e.manifest for e in scans.scan(store)}
    for step in (25, 30):  # as if committed by an agent after the listing
        scans.forget(step)
    listed = _root_listings(monkeypatch)
    assert [e.step for e in scans.committed(store, None)] == [5, 10, 15, 20]
    scans.learned(manifests[25])
    scans.learned(manifests[30])
    keep = ckpt.Keep(last=2)
    doomed = catalog.retired(scans.committed(store, None), keep, in_flight={35})[1]
    assert doomed == [5, 10, 15, 20] and listed == []
    monkeypatch.setattr(catalog, "FULL_SCAN_S", 0.0)  # and an old listing is done again
    assert [e.step for e in scans.committed(store, None)] == [5, 10, 15, 20, 25, 30] and len(listed) == 1
