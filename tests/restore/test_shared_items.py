"""`ckpt.restore.shared_items.exchange` on 2 real gloo ranks, over a table of cases: a value
that several ranks load is read once, by the rank that serves its file, and sent; where that
rank did not or could not read it, the rank that waits reads it itself; a rank that failed
still takes its part, so that none is left alone in a collective. (The restores that use it
are in test_shared_reads.py.)"""

from __future__ import annotations

import json

import pytest

from tests.support.launch import WORKERS, run

ZERO = [["__0_0.distcp", 0, 5]]


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("share")
    codes = run(2, WORKERS / "share_worker.py", str(out), log_dir=out, timeout=240)
    assert codes == [0, 0], "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# case -> what each rank loaded, what it asked the store for, and its error (None: none)
EXPECTED = {
    "served": [({}, [], None), ({"value0": "zero!"}, [], None)],
    "unread by its server": [({}, [ZERO], None), ({"value0": "zero!"}, [], None)],
    "its server cannot read it": [({}, [ZERO], None), ({"value0": "zero!"}, [ZERO], None)],
    "its server failed its load": [({}, [], None), ({"value0": "zero!"}, [], None)],
    "its server holds no metadata": [({}, [], None), ({"value0": "zero!"}, [ZERO], None)],
    "both wait": [({"value1": "one!!"}, [], None), ({"value0": "zero!"}, [], None)],
    "nobody waits": [({}, [], None), ({}, [], None)],
    "a waiting rank failed its load": [({}, [], None), ({}, [], None)],
    "a rank that must read it itself cannot": [({}, [ZERO], None), ({}, [ZERO], "OSError: the store is down")],
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_shared_value_is_read_once_and_reaches_the_ranks_that_wait_for_it(seen, case):
    for rank, (loaded, asked, error) in enumerate(EXPECTED[case]):
        got = seen[rank][case]
        assert (got["loaded"], got["asked"], got["error"]) == (loaded, asked, error), (rank, got)


def test_a_restore_where_no_rank_waits_takes_one_all_reduce_and_received_bytes_are_counted(seen):
    assert [s["nobody waits"]["all_reduces"] for s in seen] == [1, 1]
    assert [s["served"]["all_reduces"] for s in seen] == [2, 2]  # then the bitmap; a gather and a broadcast follow
    assert [s["served"]["received"] for s in seen] == [0, 5]
