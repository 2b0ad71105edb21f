"""ckpt's collectives over its own gloo groups (`ckpt.collectives.Group`) on 3 real ranks: a
broadcast takes one collective where torch's object broadcast takes two, a gather of short
objects one, and what does not fit takes the long way without losing anything."""

from __future__ import annotations

import json
import pickle

from ckpt.collectives import _SHORT
from tests.support.launch import WORKERS, run

WORKER = WORKERS / "group_worker.py"


def test_short_objects_take_one_collective_and_long_ones_arrive_whole(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    codes = run(3, WORKER, str(tmp_path), log_dir=logs, timeout=240)
    assert codes == [0, 0, 0], "\n".join((logs / f"rank{r}.log").read_text()[-3000:] for r in range(3))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r in range(3):
        s = seen[r]
        one, two = ["broadcast"], ["broadcast", "broadcast"]
        assert s["broadcast small"] == [repr({"plan": [3, 2, 1], "why": None}), one]
        assert s["broadcast fits"][1] == one and s["broadcast just over"][1] == two and s["broadcast large"][1] == two
        assert s["broadcast large"][0] == seen[0]["broadcast large"][0]  # every rank got rank 0's bytes
        assert s["broadcast fits"][0] == seen[0]["broadcast fits"][0] and s["broadcast just over"][0] == seen[0]["broadcast just over"][0]
    assert seen[0]["large equal"] is True
    # gather_short: one collective; rank 0 gets every object, TooLong(n) for one that did not fit
    small = [{"rank": r, "files": ["a"] * r} for r in range(3)]
    assert seen[0]["gather_short small"] == [small, ["gather"]]
    assert [s["gather_short small"] for s in seen[1:]] == [[None, ["gather"]]] * 2
    first_cap = 4 << 10
    got, n = seen[0]["gather_short long"]
    assert n == ["gather"] and got[:2] == small[:2] and got[2] == first_cap - 7  # the pickle's length
    got, n, cap = seen[0]["gather_short after fit"]
    assert n == ["gather"] and got[2] == first_cap - 7 and cap == 2 * first_cap
    assert seen[0]["gather_short past max"] == [small, ["gather_object"], 0]
    for s in seen:
        assert s["gather_short after fit"][2] == 2 * first_cap and s["gather_short past max"][2] == 0
    # saves whose entries did not fit commit all the same, asking every rank again (Group.gather),
    # with more room from then on, alike on every rank; once it fits, one gather a save
    for s in seen:
        assert s["saves"] == seen[0]["saves"]
    steps, caps, gathers, object_gathers = zip(*seen[0]["saves"], strict=True)
    assert steps == (1, 2, 3, 4) and gathers == (1, 1, 1, 1)
    assert object_gathers[0] == 1 and object_gathers[-1] == 0 and caps[0] > 64
    for (cap, again), before in zip(zip(caps, object_gathers, strict=True), (64, *caps), strict=False):
        assert cap > before if again else cap == before
    assert _SHORT > 8 and len(pickle.dumps(b"")) < _SHORT
