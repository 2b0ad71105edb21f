"""A restore's survey of an object store (issue 40): the root's top level and a look at each
manifest, and the chosen step's directory listed whole in parallel pages. What it decides must
be what the recursive listing decided, for every kind of root a restore meets."""

import boto3
import pytest
import torch

import ckpt
from ckpt.restore.load import _restore_plan
from ckpt.storage import catalog, s3
from ckpt.storage.store import Store


def _saved(root: str, options: dict, steps: int) -> dict[int, torch.Tensor]:
    """The weights saved at each step."""
    torch.manual_seed(0)
    m, weights = torch.nn.Linear(8, 8), {}
    with ckpt.Checkpointer(root, model=m, storage_options=options, interval=None, save_on_exit=False) as cp:
        for _ in range(steps):
            with torch.no_grad():
                m.weight.add_(1.0)
            cp.step_done()
            cp.save(blocking=True)
            weights[cp.step] = m.weight.detach().clone()
    return weights


def _objects(root: str, options: dict):
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    return boto3.client("s3", endpoint_url=options["endpoint_url"]), bucket, prefix


def _gone_data(c, bucket, prefix):
    c.delete_object(Bucket=bucket, Key=f"{prefix}/step-0000000003/__0_0.distcp")


def _short_data(c, bucket, prefix):
    c.put_object(Bucket=bucket, Key=f"{prefix}/step-0000000003/__0_0.distcp", Body=b"short")


def _no_manifest(c, bucket, prefix):
    c.delete_object(Bucket=bucket, Key=f"{prefix}/step-0000000003/manifest.json")


def _stray_object(c, bucket, prefix):
    c.put_object(Bucket=bucket, Key=f"{prefix}/step-0000000009", Body=b"not a checkpoint")


def _odd_name(c, bucket, prefix):
    c.put_object(Bucket=bucket, Key=f"{prefix}/step-12/manifest.json", Body=b"{}")


def _manifest_a_directory(c, bucket, prefix):
    c.delete_object(Bucket=bucket, Key=f"{prefix}/step-0000000003/manifest.json")
    c.put_object(Bucket=bucket, Key=f"{prefix}/step-0000000003/manifest.json/x", Body=b"{}")


def _corrupt_manifest(c, bucket, prefix):
    c.put_object(Bucket=bucket, Key=f"{prefix}/step-0000000003/manifest.json", Body=b'{"step": 3')


def _nothing(c, bucket, prefix):
    pass


# (what is done to a root of steps 1-3, the step restored, the steps any save must skip)
ROOTS = [
    ("as saved", _nothing, 3, {1, 2, 3}),
    ("the newest's data file deleted", _gone_data, 2, {1, 2, 3}),
    ("the newest's data file cut short", _short_data, 2, {1, 2, 3}),
    ("the newest never committed", _no_manifest, 2, {1, 2}),
    ("an object named like a step", _stray_object, 3, {1, 2, 3, 9}),
    ("a name in other digits", _odd_name, 3, {1, 2, 3}),
    ("a directory where the manifest goes", _manifest_a_directory, 2, {1, 2}),
    ("the newest's manifest corrupt", _corrupt_manifest, 2, {1, 2, 3}),
]


@pytest.mark.parametrize("what,change,restored,taken", ROOTS, ids=[r[0] for r in ROOTS])
def test_the_survey_picks_what_the_recursive_listing_picks(s3_root, s3_options, what, change, restored, taken):
    saved = _saved(s3_root, s3_options, 3)
    change(*_objects(s3_root, s3_options))
    store = Store(s3_root, storage_options=s3_options)
    surveyed, strays = store.survey(whole=False)
    listed, strays_listed = store.survey()
    assert strays == strays_listed
    assert {s for s, lst in surveyed.items() if lst.has_manifest} == {s for s, lst in listed.items() if lst.has_manifest}
    assert all(not lst.whole and set(lst.files) <= {"manifest.json"} for lst in surveyed.values())
    with_manifest = [s for s, lst in surveyed.items() if lst.has_manifest]
    assert [surveyed[s].manifest_mtime for s in with_manifest] == pytest.approx([listed[s].manifest_mtime for s in with_manifest], abs=1.0)
    # the catalog's pick, and the steps a run must not save into, are the recursive listing's:
    # the candidate was checked against its whole listing
    assert _restore_plan(store, "latest", None, [], 1)[:2] == ([restored], taken)
    picked = catalog.restore_candidates(store, listings=surveyed)[0]
    assert [e.step for e in picked[:1]] == [e.step for e in catalog.restore_candidates(store, listings=listed)[0][:1]] == [restored]
    m2 = torch.nn.Linear(8, 8)
    with ckpt.Checkpointer(s3_root, model=m2, storage_options=s3_options, save_on_exit=False, interval=None) as cp:
        assert cp.step == restored
    assert torch.equal(m2.weight, saved[restored])


@pytest.mark.parametrize("page", [2, 3, 7, 1000])
def test_a_step_listed_in_parallel_pages_is_the_step_listed_one_page_after_another(s3_root, s3_options, monkeypatch, page):
    """Pages start after every `page`-th expected name; keys that are not expected (another
    save's markers, debris) fall between them and are listed all the same."""
    c, bucket, prefix = _objects(s3_root, s3_options)
    step_dir = f"{prefix}/step-0000000005"
    expected = [f"__{r}_0.distcp" for r in range(13)] + [".metadata", "manifest.json"]
    unexpected = [".durable/abc.1", ".durable/abc.2", "__4_0.distcp.tmp", "zz-debris", "__10_1.distcp"]
    for i, name in enumerate(expected + unexpected):
        c.put_object(Bucket=bucket, Key=f"{step_dir}/{name}", Body=b"x" * i)
    c.put_object(Bucket=bucket, Key=f"{prefix}/step-0000000006/__0_0.distcp", Body=b"next step's")
    store = Store(s3_root, storage_options=s3_options)
    one_after_another = store.list_step(5)
    monkeypatch.setattr(s3, "LIST_PAGE", page)
    paged = store.list_step(5, expect=expected)
    assert paged is not None and one_after_another is not None
    assert paged.files == one_after_another.files
    assert len(paged.files) == len(expected) + len(unexpected)
    assert store.list_step(7, expect=expected) is None  # no such directory
