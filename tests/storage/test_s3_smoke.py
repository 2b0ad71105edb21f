import pytest
import torch

import ckpt


def test_single_process_save_and_restore_on_s3(s3_root):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ckpt.Checkpointer(s3_root, model=m, optimizer=opt, interval=ckpt.Every(steps=2)) as cp:
        for _ in range(cp.step, 4):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    want = m.weight.detach().clone()
    m2 = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer(s3_root, model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1)) as cp:
        assert cp.step == 4
    assert torch.equal(m2.weight, want)


def test_a_bucket_that_does_not_exist_is_a_storage_error_not_a_fresh_start(s3_env):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ckpt.StorageError, match="does not exist"):
        with ckpt.Checkpointer("s3://no-such-bucket-ckpt/run", model=m):
            pass


def test_a_restore_reads_each_manifest_once_and_asks_no_object_for_its_size(s3_root, s3_options):
    """Round trips are what a restore waits for on an object store: the step's manifest and
    `.metadata` are read once (the ones checked are the ones restored from), the bucket is
    checked once, and the files (sizes known from the manifest) read without a HEAD first."""
    from tests.support.s3proxy import FaultyProxy

    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    with ckpt.Checkpointer(s3_root, model=m, storage_options=s3_options, interval=None, save_on_exit=False) as cp:
        cp.step_done()
        cp.save(blocking=True)
    proxy = FaultyProxy(s3_options["endpoint_url"])
    try:
        m2 = torch.nn.Linear(64, 64)
        with ckpt.Checkpointer(s3_root, model=m2, storage_options={**s3_options, "endpoint_url": proxy.url}, save_on_exit=False) as cp:
            assert cp.step == 1
            seen = list(proxy.requests)
    finally:
        proxy.close()
    assert torch.equal(m2.weight, m.weight)
    bucket, step_dir = s3_root.removeprefix("s3://").split("/")[0], "/".join([s3_root.removeprefix("s3://"), "step-0000000001"])
    reads = [path.removeprefix(f"/{step_dir}/") for kind, path in seen if kind == "range" and path.startswith(f"/{step_dir}/")]
    assert reads.count("manifest.json") == 1, seen
    assert reads.count(".metadata") == 1, seen  # checked by the catalog, then loaded from those bytes
    # The bucket, once; the survey's look at the one step's manifest; no data file's size.
    assert [path.strip("/") for kind, path in seen if kind == "head"] == [bucket, f"{step_dir}/manifest.json"], seen


def test_a_restore_of_a_named_step_lists_the_root_once_and_reads_no_other_metadata(s3_root, s3_options):
    """restore=STEP and restore='none' ask the store no more than restore='latest' does: one survey of the
    root serves the step, the steps already taken and the newest commit time alike (it was
    three), and the only `.metadata` read is the restored step's (the newest one's was read and
    checksummed too, for its commit time alone)."""
    from tests.support.s3proxy import FaultyProxy

    m = torch.nn.Linear(16, 16)
    with ckpt.Checkpointer(s3_root, model=m, storage_options=s3_options, interval=None, save_on_exit=False) as cp:
        for _ in range(3):
            cp.step_done()
            cp.save(blocking=True)

    def restore(restore: int | str) -> tuple[int, list[tuple[str, str]]]:
        proxy = FaultyProxy(s3_options["endpoint_url"])
        try:
            opts = {**s3_options, "endpoint_url": proxy.url}
            with ckpt.Checkpointer(s3_root, model=torch.nn.Linear(16, 16), storage_options=opts, restore=restore, save_on_exit=False) as cp:
                return cp.step, list(proxy.requests)
        finally:
            proxy.close()

    root = s3_root.removeprefix("s3://")
    bucket = root.split("/")[0]

    def listings(seen: list[tuple[str, str]]) -> int:
        return sum(1 for kind, path in seen if kind == "get" and path.strip("/") == bucket)

    step, named = restore(2)
    latest_step, latest = restore("latest")
    assert (step, latest_step) == (2, 3)
    assert listings(named) == listings(latest) >= 2, (named, latest)  # the events, the root
    assert [path for kind, path in named if path.endswith("/.metadata")] == [f"/{root}/step-0000000002/.metadata"], named
    # restore='none' (steps taken and the newest commit time, to skip and date after them): the same.
    fresh_step, fresh = restore("none")
    assert fresh_step == 0 and listings(fresh) == listings(latest), fresh
    assert not [path for kind, path in fresh if path.endswith("/.metadata")], fresh


def test_only_a_restore_keeps_the_checked_bytes_and_only_of_the_checkpoint_it_picks(tmp_path):
    from ckpt.storage import catalog
    from ckpt.storage.store import Store

    m = torch.nn.Linear(8, 8)
    with ckpt.Checkpointer(tmp_path, model=m, interval=None, save_on_exit=False) as cp:
        for _ in range(2):
            cp.step_done()
            cp.save(blocking=True)
    store = Store(tmp_path)
    good, _ = catalog.restore_candidates(store, keep=True)
    assert [e.step for e in good] == [2, 1]
    assert good[0].doc == (tmp_path / "step-0000000002" / "manifest.json").read_bytes()
    assert good[0].metadata == (tmp_path / "step-0000000002" / ".metadata").read_bytes()
    assert good[1].doc is good[1].metadata is None
    plain, _ = catalog.restore_candidates(store)
    assert all(e.doc is e.metadata is None for e in plain)
    assert catalog.find(store, 1).doc is None and catalog.find(store, 1, keep=True).doc is not None


def test_a_restart_reads_the_newest_run_records_not_the_whole_history(s3_root, s3_options):
    """The restart event needs the run before this one, not every record of a history that
    grows by two objects a restart: a few GETs of run records, whatever the history holds."""
    import time

    from ckpt.events import RunRecord, write_run
    from ckpt.storage.store import Store
    from tests.support.s3proxy import FaultyProxy

    m = torch.nn.Linear(8, 8)
    with ckpt.Checkpointer(s3_root, model=m, storage_options=s3_options, interval=None, save_on_exit=False) as cp:
        for _ in range(3):
            cp.step_done()
        cp.save(blocking=True)
        for _ in range(4):
            cp.step_done()
        cp.history.beat()  # the last step it reached: 7
    store = Store(s3_root, s3_options)
    t0 = time.time() - 100_000  # 30 runs before that one, hours ago
    for i in range(30):
        when = t0 + i * 1000
        run_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f"-{i:08x}"
        write_run(store, RunRecord(run_id, 4, when, when + 500, 0, 100 + i, "error: old"))
    proxy = FaultyProxy(s3_options["endpoint_url"])
    try:
        with ckpt.Checkpointer(s3_root, model=torch.nn.Linear(8, 8), storage_options={**s3_options, "endpoint_url": proxy.url},
                               interval=None, save_on_exit=False) as cp:  # fmt: skip
            ev = cp.restart_event
            seen = list(proxy.requests)
    finally:
        proxy.close()
    assert ev is not None and ev.step == 3 and ev.steps_lost == 4 and ev.world_size_before == 1, ev
    assert ev.cause == "exited", ev  # the last run's end, not an older one's
    runs_read = [path for kind, path in seen if kind in ("GET", "range") and "/events/run-" in path]
    assert 1 <= len(runs_read) <= 4, runs_read
